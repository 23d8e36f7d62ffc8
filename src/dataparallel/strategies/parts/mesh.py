"""2-D meshes: shard within groups of S ranks, replicate across R such groups (HSDP).

[Note: mesh] A job of N = R x S ranks, rank r at row r // S (its replica) and column r % S
(its shard index). The S ranks of a row are a *shard group*: a sharded strategy splits its
flat buffers over them ([Note: shard layout] with world_size = S), so per-rank memory follows
the ZeRO theory with N replaced by S. The R ranks of a column are a *replicate group*: they
hold the same shard, and the reduced shard gradient is all-reduced across them. The mean still
divides by N, in one place (the bucket, [Note: reduction interface] in comm/hooks.py).
Rows are consecutive ranks, so with S = ranks per host, the heavy reduce-scatter and
all-gather stay inside a host and only 1/S of the gradient crosses hosts. S = N is the 1-D
layout (no replicate group), S = 1 is DDP's (every rank replicates everything).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ...comm import Comm, Tracer


@dataclass(frozen=True)
class Mesh:
    """A replicate x shard layout of a group's ranks ([Note: mesh]); build it with `init_mesh`.

    shard_size: S, ranks per shard group.
    replicate_size: R, shard groups (replicas); R x S is the group's size.
    group: every rank of the mesh.
    shard_group: this rank's shard group (the S ranks of its row).
    replicate_group: this rank's replicate group (the R ranks of its column).
    """

    shard_size: int
    replicate_size: int
    group: dist.ProcessGroup
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup


def init_mesh(shard_size: int, group: dist.ProcessGroup | None = None) -> Mesh:
    """Split `group` (default: every rank) into shard groups of `shard_size` consecutive ranks
    and the replicate groups across them. Collective over `group`: each rank creates the two
    groups it belongs to, synchronising only with their members, so ranks outside `group` need
    not call it."""
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"init_mesh: shard_size={shard_size!r} must be an integer >= 1")
    if n % shard_size:
        raise ValueError(
            f"init_mesh: shard_size={shard_size} does not divide the {n} ranks; pick a divisor "
            f"of {n}"
        )
    ranks = [dist.get_global_rank(group, r) for r in range(n)]
    me = dist.get_rank(group)
    row = ranks[me - me % shard_size : me - me % shard_size + shard_size]
    column = ranks[me % shard_size :: shard_size]
    return Mesh(
        shard_size=shard_size,
        replicate_size=n // shard_size,
        group=group,
        shard_group=dist.new_group(row, use_local_synchronization=True),
        replicate_group=dist.new_group(column, use_local_synchronization=True),
    )


@dataclass(frozen=True)
class Groups:
    """The collectives a strategy talks through.

    world: every rank training the model (model checks, used flags, found-inf).
    shard: the ranks a flat buffer is split over (all of `world` without a mesh).
    replicate: the ranks holding the same shard, or None with a single replica.
    """

    world: Comm
    shard: Comm
    replicate: Comm | None

    def comms(self) -> list[Comm]:
        """world, shard and replicate, each once (a 1-D layout's shard group is its world)."""
        out: list[Comm] = []
        for comm in (self.world, self.shard, self.replicate):
            if comm is not None and all(comm is not c for c in out):
                out.append(comm)
        return out

    @property
    def divisor(self) -> int:
        """How many ranks a mean divides by."""
        return self.world.world_size

    @classmethod
    def build(
        cls,
        group: dist.ProcessGroup | None,
        mesh: Mesh | None,
        tracer: Tracer | None = None,
        pairwise: bool | None = None,
    ) -> Groups:
        world = Comm(mesh.group if mesh is not None else group, tracer, pairwise)
        if mesh is None or mesh.shard_size == world.world_size:
            return cls(world, world, None)
        shard = Comm(mesh.shard_group, world.tracer, pairwise)
        replicate = Comm(mesh.replicate_group, world.tracer, pairwise)
        return cls(world, shard, replicate if mesh.replicate_size > 1 else None)

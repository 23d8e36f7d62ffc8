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

[Note: device mesh] PyTorch's `DeviceMesh` is the currency between parallelisms, and `Mesh`
converts to and from it in one place (`as_layout`, `Mesh.device_mesh`):
- a 1-D DeviceMesh is the data-parallel group itself: S = N, one replica;
- a 2-D DeviceMesh named ("replicate", "shard") is the R x S layout above, its groups those of
  its two dimensions (no new group but the one over all of its ranks);
- a sub-mesh of a larger mesh (`mesh["dp"]` of a ("dp", "tp") mesh) is taken the same way: data
  parallelism runs over its ranks only, and the other dimensions belong to the model (its
  DTensor parameters, [Note: tensor-parallel parameters] in parts/tensor_parallel.py).
`init_mesh(shard_size)` keeps building the two groups itself (any group, synchronising only
with their members) and `Mesh.device_mesh` wraps them as a ("replicate", "shard") DeviceMesh
without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...comm import Comm, Tracer
from ...comm.groups import subgroup
from .parallel_layout import Layout


@dataclass(frozen=True)
class Mesh:
    """A replicate x shard layout of a group's ranks ([Note: mesh]); build it with `init_mesh`.

    shard_size: S, ranks per shard group.
    replicate_size: R, shard groups (replicas); R x S is the group's size.
    group: every rank of the mesh.
    shard_group: this rank's shard group (the S ranks of its row).
    replicate_group: this rank's replicate group (the R ranks of its column).
    ranks: the global ranks of the mesh in row-major order (row = replica); () if unknown.
    elastic: the replicas may change while training (live recovery, train/live/recovery.py): a
        strategy keeps three groups even with one replica, so that `rebind` can move each.
    """

    shard_size: int
    replicate_size: int
    group: dist.ProcessGroup
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup
    ranks: tuple[int, ...] = ()
    elastic: bool = False

    @cached_property
    def device_mesh(self) -> DeviceMesh:
        """The same layout as a torch DeviceMesh named ("replicate", "shard") over the groups
        already built ([Note: device mesh]); no collective."""
        ranks = self.ranks or tuple(
            dist.get_global_rank(self.group, r) for r in range(dist.get_world_size(self.group))
        )
        layout = torch.tensor(ranks, dtype=torch.int).view(self.replicate_size, self.shard_size)
        return DeviceMesh.from_group(
            [self.replicate_group, self.shard_group],
            _device_type(self.group),
            mesh=layout,
            mesh_dim_names=("replicate", "shard"),
        )


def _device_type(group: dist.ProcessGroup) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def as_layout(
    mesh: Mesh | DeviceMesh,
) -> tuple[dist.ProcessGroup | None, Mesh | None]:
    """(group, Mesh) for `Groups.build` from what `parallelize(mesh=)` takes ([Note: device
    mesh]): a `Mesh` as is; a 1-D DeviceMesh, its group (no Mesh: one replica); a 2-D
    DeviceMesh named ("replicate", "shard"), HSDP. Collective over the mesh's ranks in the 2-D
    case (the group of all of them is created, unless they are every rank)."""
    if isinstance(mesh, Mesh):
        return None, mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"parallelize: mesh={mesh!r} must be a torch DeviceMesh (1-D, or 2-D named "
            "('replicate', 'shard')), a dataparallel.Mesh from dataparallel.init_mesh, or None"
        )
    if mesh.ndim == 1:
        return mesh.get_group(), None
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names != ("replicate", "shard"):
        raise ValueError(
            f"parallelize: a DeviceMesh of {mesh.ndim} dimensions named {names} is not a data-"
            "parallel mesh; pass its data-parallel part: one dimension (mesh['dp']) or two "
            "named ('replicate', 'shard') (mesh['replicate', 'shard'])"
        )
    replicate, shard = mesh.mesh.shape
    if len(ranks) == dist.get_world_size():
        whole = dist.group.WORLD
    else:
        whole = subgroup(list(ranks))
    return None, Mesh(
        shard_size=int(shard),
        replicate_size=int(replicate),
        group=whole,
        shard_group=mesh.get_group("shard"),
        replicate_group=mesh.get_group("replicate"),
        ranks=ranks,
    )


def init_mesh(
    shard_size: int, group: dist.ProcessGroup | None = None, elastic: bool = False
) -> Mesh:
    """Split `group` (default: every rank) into shard groups of `shard_size` consecutive ranks
    and the replicate groups across them. Collective over `group`: each rank creates the two
    groups it belongs to, synchronising only with their members, so ranks outside `group` need
    not call it. elastic: see `Mesh`."""
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
    layout, me = Layout(n, shard_size=shard_size), dist.get_rank(group)  # [Note: layout]
    row = [ranks[r] for r in layout.shard_ranks(me)]
    column = [ranks[r] for r in layout.replicate_ranks(me)]
    return Mesh(
        shard_size=shard_size,
        replicate_size=n // shard_size,
        group=group,
        shard_group=subgroup(row, group),  # with `group`'s timeout ([Note: inherited timeout])
        replicate_group=subgroup(column, group),
        ranks=tuple(ranks),
        elastic=elastic,
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

    def rebind(self, mesh: Mesh, strategy: str) -> None:
        """Talk through another mesh from now on (a live run's next generation of HSDP
        replicas, train/live/recovery.py): `mesh` is built elastic, of this layout's shard size,
        and puts this rank at its place in its shard group, so each rank keeps its shards; the
        world and the replicas change (and with them the divisor)."""
        if not isinstance(mesh, Mesh) or self.replicate is None:
            raise ValueError(
                f"strategy {strategy!r} moves only from an elastic mesh to another mesh "
                "(dp.init_mesh(S, group, elastic=True)); it cannot move its shards"
            )
        place = dist.get_rank(mesh.shard_group)
        if mesh.shard_size != self.shard.world_size or place != self.shard.rank:
            raise ValueError(
                f"strategy {strategy!r}: this rank holds shard {self.shard.rank} of "
                f"{self.shard.world_size}; the new mesh puts it at {place} of {mesh.shard_size}"
            )
        self.world.rebind(mesh.group)
        self.shard.rebind(mesh.shard_group)
        self.replicate.rebind(mesh.replicate_group)

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
        if mesh is None or mesh.shard_size == world.world_size and not mesh.elastic:
            return cls(world, world, None)
        shard = Comm(mesh.shard_group, world.tracer, pairwise)
        replicate = Comm(mesh.replicate_group, world.tracer, pairwise)
        keep = mesh.replicate_size > 1 or mesh.elastic  # one replica now, more later
        return cls(world, shard, replicate if keep else None)

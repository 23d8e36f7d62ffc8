"""Layout: the parallel shape of a run's ranks, validated once and named by purpose (pure).

[Note: layout] A world of N ranks trains one model as tp x shard x replicas:
- tensor parallelism: the T ranks of a tp row hold parts of every split layer and read the same
  data; they are consecutive ranks (rank r is at column r % T), so the activation all-reduces
  stay inside a host ([Note: the job's mesh] in train/tensor_parallel.py);
- data parallelism: the N / T ranks that read different data, rank r at data rank r // T (the
  ranks of one tp column: T apart);
- sharding: those data ranks form shard groups of S consecutive data ranks, over which a ZeRO
  strategy splits its flat buffers ([Note: mesh] in parts/mesh.py); S is one whole copy of the
  model's state, a *replica*;
- replication: the R = N / (T x S) replicas hold the same shards; the data rank at index i of
  each replica forms a replicate group, across which gradients are all-reduced (HSDP) or, under
  an averager (local SGD, DiLoCo), the parameters are averaged every H steps;
- the loss: the T peers of a tp row compute the same loss, so only the first of each row counts
  in the sums over every rank (tokens, the loss, validation).
This class is the one place those numbers are derived: `compose` builds it (`Composed.layout`),
the job, its checkpoints, live recovery, the checks and the planner read it; `init_mesh` builds
the groups it names. It needs no process group: every answer is arithmetic on global ranks of
the composed world (0..world - 1).
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout whose degrees do not fit: `field` (a `Layout` field), the problem and the fix;
    `str(error)` is one line, "Layout.tp: 3 does not divide the 8 ranks; use a divisor of them".
    Front ends name their own flag for `field` (the job: --tp, --shard-group; the planner:
    --ranks, --tp, --shard-size; the recipe: Recipe.tp, Recipe.shard_size)."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"Layout.{field}: {problem}; {fix}")


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout ([Note: layout]); validated on construction.

    world: N, every rank of the composed world.
    tp: T, tensor-parallel degree: consecutive ranks split the model's layers; 1: none.
    shard_size: S as given: the data ranks of one replica (one shard group); 0: every data rank
        for a sharded strategy, one rank for DDP or under an averager (`shard` resolves it).
    sharded: whether the strategy splits the model's state over its shard group (ZeRO-1/2/3);
        False for DDP, whose every rank holds a whole copy (a shard group of one).
    averaged: whether an averager (local SGD, DiLoCo) runs across the replicas: each replica
        then keeps its own parameters and optimizer state (a checkpoint saves each apart).
    """

    world: int
    tp: int = 1
    shard_size: int = 0
    sharded: bool = True
    averaged: bool = False

    def __post_init__(self):
        for name, least in (("world", 1), ("tp", 1), ("shard_size", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(
                    name, f"{value!r} is not an integer", f"give an integer >= {least}"
                )
            if value < least:
                fix = "use 1 (no tensor parallelism) or more" if name == "tp" else f"use {least}+"
                raise LayoutError(name, f"{value} is below {least}", fix)
        if self.world % self.tp:
            raise LayoutError(
                "tp", f"{self.tp} does not divide the {self.world} ranks", "use a divisor of them"
            )
        if self.shard_size and self.data_size % self.shard_size:
            raise LayoutError(
                "shard_size",
                f"{self.shard_size} does not divide the {self.data_size} ranks",
                "use a divisor, or 0 for none",
            )

    # -- the degrees ----------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        """The ranks that read different data (N / T): what a step's batch is split over."""
        return self.world // self.tp

    @property
    def shard(self) -> int:
        """S resolved: the data ranks of one replica (`shard_size`, else see its field)."""
        if self.shard_size:
            return self.shard_size
        return self.data_size if self.sharded and not self.averaged else 1

    @property
    def replicas(self) -> int:
        """R: the copies of the model's state (N / (T x S))."""
        return self.data_size // self.shard

    @property
    def hsdp(self) -> bool:
        """Whether the strategy runs on a 2-D replicate x shard mesh: a shard size given below
        the data ranks, without an averager (which owns the cross-replica step instead)."""
        return not self.averaged and 0 < self.shard_size < self.data_size

    @property
    def saved_replicas(self) -> int:
        """The replicas whose state differs, which a checkpoint saves apart: R under an
        averager, else 1 (HSDP replicas and DDP ranks hold the same)."""
        return self.replicas if self.averaged else 1

    # -- a rank's answers, by purpose ------------------------------------------------------
    def data_rank(self, rank: int) -> int:
        """Data loading: which of the `data_size` slices of a step `rank` reads."""
        return self._checked(rank) // self.tp

    def counts_loss(self, rank: int) -> bool:
        """The loss: whether `rank`'s token and loss sums count in the sums over every rank
        (the first rank of each tp row; its peers hold the same)."""
        return self._checked(rank) % self.tp == 0

    def loss_weight(self, rank: int) -> int:
        """1 for a rank whose sums count (`counts_loss`), else 0."""
        return int(self.counts_loss(rank))

    def replica_of(self, rank: int) -> int:
        """The replica `rank` belongs to, 0..replicas - 1."""
        return self.data_rank(rank) // self.shard

    def saved_replica_of(self, rank: int) -> int:
        """The replica whose state `rank` saves (`saved_replicas`): its replica under an
        averager, else 0."""
        return self.replica_of(rank) if self.averaged else 0

    def tp_ranks(self, rank: int) -> list[int]:
        """Tensor parallelism: the T consecutive ranks of `rank`'s tp row."""
        first = self._checked(rank) - rank % self.tp
        return list(range(first, first + self.tp))

    def data_ranks(self, rank: int) -> list[int]:
        """The data-parallel group of `rank`: the ranks of its tp column, T apart."""
        return list(range(self._checked(rank) % self.tp, self.world, self.tp))

    def shard_ranks(self, rank: int) -> list[int]:
        """Sharding: the S ranks of `rank`'s shard group (its replica)."""
        column = self.data_ranks(rank)
        first = self.replica_of(rank) * self.shard
        return column[first : first + self.shard]

    def replicate_ranks(self, rank: int) -> list[int]:
        """Replication: the R ranks holding the same shard as `rank`, one in each replica."""
        return self.data_ranks(rank)[self.data_rank(rank) % self.shard :: self.shard]

    def resized(self, world: int) -> Layout:
        """The same layout on another world (a live run's next generation of replicas)."""
        return Layout(world, self.tp, self.shard_size, self.sharded, self.averaged)

    def _checked(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise LayoutError(
                "world", f"rank {rank} is outside 0..{self.world - 1}", "give a rank of it"
            )
        return rank

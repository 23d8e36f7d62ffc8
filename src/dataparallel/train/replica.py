"""An HSDP replica of a live run: `--shard-group` S processes that train, fail and heal together.

    ranks = ReplicaRanks(index=1, shard=2, start=4)     # this process: index 1 of 2
    world = ranks.meet(store, timeout, world)           # a replacement: its own S ranks first
    rank = ranks.rank(membership, slot)                 # its rank in a generation
    ranks.rebind(state)                                 # the model onto the generation's mesh
    if not ranks.vote(state, failed=False): ...         # every rank of the replica got through?

[Note: HSDP replicas] Under `--recovery live --shard-group S` (ZeRO-1/2 inside each replica) a
replica is S processes, one shard group, and the failure domain. The launcher starts them
together, and when one of them ends otherwise than with 0 it kills the others and starts S new
ones (`Replica` in live_launch.py). Each process knows its slot and its index i in 0..S-1:
- only index 0 reports for the replica; all S wait for the decision. In a generation the
  replica at position p has the ranks p x S .. p x S + S - 1 (index i at p x S + i), so every
  rank keeps its place in its shard group, and with it its shards: the generation's mesh is
  built again (`init_mesh(S, elastic=True)`) and the model moves to it (`dp.rebind(model,
  mesh)`: new world, new replicas, new divisor);
- *the vote*: a step's collectives across replicas (the token and loss all-reduces, the
  gradients' all-reduce across replicas) may fail on some ranks of a replica and not on the
  others. A rank that went on would apply its update while its siblings rewind, and its shard
  would be a step ahead of theirs. So before any rank applies its update, the replica's ranks
  agree in one all-reduce of one number over their shard group that every one of them got
  through (`vote`, called by the trainer as `state.agree`); a rank that failed votes from its
  error path instead, and then all of them rewind together. A rank's siblings are alive
  whenever its replica is (a lost sibling loses the replica), so the vote completes. An
  evaluation ends with the same vote. Replicas may still differ by a step (one replica's
  all-reduce completed where another's failed): the one behind is healed, as under DDP;
- the heal goes by index: rank i of the source replica broadcasts its own part of the state
  (the parameters, its optimizer shard, the data position) to rank i of each healed replica,
  over the replicate group of index i;
- a replacement's S processes first meet among themselves (a group of S under
  `start/<n>/pg`, n counting the launcher's starts) and build the model sharded as the others
  hold it, on an elastic mesh of one replica; then they enter as any replacement does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import dataparallel as dp

from ..comm.membership import Membership
from .trainer import TrainState


class SiblingFailed(RuntimeError):
    """Another rank of this replica failed a collective of the step: every rank rewinds."""


@dataclass(frozen=True)
class ReplicaRanks:
    """This process's place in its replica ([Note: HSDP replicas]).

    index: its index in the replica's shard group, 0..shard - 1 (0 reports for the replica).
    shard: S, the processes of a replica (1: a replica is one process, as under DDP).
    start: the launcher's count of replica starts when this one began (names its first group).
    """

    index: int = 0
    shard: int = 1
    start: int = 0

    @property
    def leader(self) -> bool:
        return self.index == 0

    def rank(self, membership: Membership, slot: int) -> int:
        return membership.rank_of(slot) * self.shard + self.index

    def size(self, membership: Membership) -> int:
        return membership.size * self.shard

    def meet(self, store: dist.Store, timeout: timedelta, world: dp.World) -> dp.World:
        """A replacement's first world: the S processes of its replica, among themselves."""
        prefix = dist.PrefixStore(f"start/{self.start}/pg", store)
        return dp.join_group(prefix, self.index, self.shard, timeout, world)

    def rebind(self, state: TrainState) -> None:
        """The model onto the mesh of the generation `state.world` is the group of."""
        dp.rebind(state.model, dp.init_mesh(self.shard, state.world.group, elastic=True))

    def vote(self, state: TrainState, failed: bool) -> bool:
        """Whether every rank of this replica got through (one all-reduce over its shard
        group); `failed`: this one did not."""
        shard_group = dp.strategy_of(state.model).groups.shard.group
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_group)
        return int(flag.item()) == 0

    def agree(self, state: TrainState) -> None:
        """`state.agree`: before the update, raise SiblingFailed unless every rank got through."""
        if not self.vote(state, failed=False):
            raise SiblingFailed("a rank of this replica failed a collective of the step")

    def heal_source(self, membership: Membership) -> int:
        """The global rank that sends this index's part of the state."""
        return self.rank(membership, membership.source)

    def heal_group(self, state: TrainState) -> dist.ProcessGroup:
        """The ranks of this index in every replica (the replicate group)."""
        return dp.strategy_of(state.model).groups.replicate.group

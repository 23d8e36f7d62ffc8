"""An HSDP replica of a live run: `--shard-group` S processes that train, fail and heal together.

    seat = Seat(index=1, shard=2, start=4)              # this process: index 1 of 2
    world = seat.meet(store, timeout, world)            # a replacement: its own S ranks first
    rank = seat.rank(membership, slot)                  # its rank in a generation
    seat.rebind(state)                                  # the model onto the generation's mesh
    vote = ReplicaVote(store, slot, seat, timeout_s)    # every rank of the replica got through?
    if not vote(failed=False): ...

[Note: HSDP replicas] Under `--recovery live --shard-group S` (ZeRO-1/2/3 inside each replica) a
replica is S processes, one shard group, and the failure domain. The launcher starts them
together, and when one of them ends otherwise than with 0 it kills the others and starts S new
ones (`Replica` in slots.py). Each process knows its slot and its index i in 0..S-1:
- only index 0 reports for the replica; all S wait for the decision. In a generation the
  replica at position p has the ranks p x S .. p x S + S - 1 (index i at p x S + i), so every
  rank keeps its place in its shard group, and with it its shards: the generation's mesh is
  built again (`init_mesh(S, elastic=True)`) and the model moves to it (`dp.rebind(model,
  mesh)`: new world, new replicas, new divisor);
- *the vote*: a step's collectives across replicas (the token and loss all-reduces, the
  gradients' all-reduce across replicas) may fail on some ranks of a replica and not on the
  others. A rank that went on would apply its update while its siblings rewind, and its shard
  would be a step ahead of theirs. So before any rank applies its update, the replica's ranks
  agree that every one of them got through (`ReplicaVote`, called by train_step as its
  `before_update`); a rank that failed votes from its error path instead, and then all of them
  rewind together. The vote goes through the launcher's store, not a collective: a collective
  on the shard group could pair with a sibling's gradient reduction still in flight there, and
  would fail as the failed collectives do. Every attempt at a step, an evaluation or a regroup
  ends with exactly one vote on every rank of the replica (a replacement asked in is voted as a
  way out of the step, like a failure), so the rounds pair; a sibling silent for the
  collective timeout + 10 s is lost, and with it the replica (`ReplicaLost`: the process ends,
  the launcher kills the others and replaces them). A regroup's outcome is voted too: if one
  rank's regroup failed (a heal broadcast cut short), all of them regroup again, so a replica
  never splits. Replicas may still differ by a step (one replica's all-reduce completed where
  another's failed): the one behind is healed, as under DDP;
- the heal goes by index: rank i of the source replica broadcasts the parameters (whole, as
  `full_state_dict` gathers them over its shard group: S times the bytes one broadcast would
  need), its own optimizer shard, the data position and the counters to rank i of each healed
  replica, over the replicate group of index i; the optimizer state matches by index because
  the shard layout is the same in every replica;
- a replacement's S processes first meet among themselves (a group of S under
  `start/<n>/pg`, n counting the launcher's starts) and build the model sharded as the others
  hold it, on an elastic mesh of one replica; then they enter as any replacement does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

import dataparallel as dp

from ..state import TrainState
from .membership import Membership
from .store import start_prefix, vote_prefix

VOTE_GRACE_S = 10.0  # beyond the collective timeout, for a sibling blocked in a collective
FAILED = 1 << 20  # what a failed rank adds to a vote's sum (more than any replica's ranks)


class SiblingFailed(RuntimeError):
    """Another rank of this replica failed a collective of the step: every rank rewinds."""


class ReplicaLost(RuntimeError):
    """A sibling did not vote in time: it is lost or hung, and with it this replica."""


@dataclass(frozen=True)
class Seat:
    """This process's seat: its place in its replica ([Note: HSDP replicas]).

    index: its index in the replica's shard group, 0..shard - 1 (0 reports for the replica).
    shard: S, the processes of a replica (1: a replica is one process, as under DDP).
    start: names the replica's first group: the launcher's count of replica starts when it
        began, or "join-<slot>" for one joined with `dataparallel join`.
    """

    index: int = 0
    shard: int = 1
    start: int | str = 0

    @property
    def leader(self) -> bool:
        """Index 0: it reports for its replica."""
        return self.index == 0

    def rank(self, membership: Membership, slot: int) -> int:
        """The rank of this process in `membership`, where `slot` is its replica."""
        return membership.rank_of(slot) * self.shard + self.index

    def size(self, membership: Membership) -> int:
        """The ranks of `membership`: S per replica."""
        return membership.size * self.shard

    def meet(self, store: dist.Store, timeout: timedelta, world: dp.World) -> dp.World:
        """A replacement's first world: the S processes of its replica, among themselves."""
        prefix = dist.PrefixStore(start_prefix(self.start), store)
        return dp.regroup(prefix, self.index, self.shard, timeout, world)

    def rebind(self, state: TrainState) -> None:
        """The model onto the mesh of the generation `state.world` is the group of."""
        dp.rebind(state.model, dp.init_mesh(self.shard, state.world.group, elastic=True))

    def heal_source(self, membership: Membership) -> int:
        """The global rank that sends this index's part of the state."""
        return self.rank(membership, membership.source)

    def heal_group(self, state: TrainState) -> dist.ProcessGroup:
        """The ranks of this index in every replica (the replicate group)."""
        return dp.handle_of(state.model).replica_group


class ReplicaVote:
    """The ranks of one HSDP replica agree, through the launcher's store, that every one of
    them got through ([Note: HSDP replicas]): `vote(failed)` is True when none failed.

    store: the run's store; slot: the replica's; seat: this process's place in it.
    timeout_s: --collective-timeout (a sibling has VOTE_GRACE_S more to vote).
    """

    def __init__(self, store: dist.Store, slot: int, seat: Seat, timeout_s: float):
        self.store = dist.PrefixStore(vote_prefix(slot, seat.start), store)
        self.seat, self.wait_s, self.round = seat, timeout_s + VOTE_GRACE_S, 0
        self.slot = slot

    def __call__(self, failed: bool) -> bool:
        """One round: each rank adds 1 (plus FAILED if it failed) to the round's sum; the last
        to add publishes the verdict, the others wait for it on the store (no polling)."""
        self.round += 1
        n = self.round
        total = self.store.add(f"{n}/sum", 1 + FAILED * int(failed))
        if total % FAILED == self.seat.shard:  # the last of the replica's ranks to vote
            verdict = "failed" if total >= FAILED else "ok"
            self.store.set(f"{n}/verdict", verdict)
        else:
            try:
                self.store.wait([f"{n}/verdict"], timedelta(seconds=self.wait_s))
            except (dist.DistError, RuntimeError):  # DistStoreError: the wait timed out
                arrived = self.store.add(f"{n}/sum", 0) % FAILED
                raise ReplicaLost(
                    f"replica {self.slot}: {self.seat.shard - arrived} of its ranks did not "
                    f"vote within {self.wait_s:g} s (lost or hung); the replica ends and is "
                    "replaced"
                ) from None
            verdict = self.store.get(f"{n}/verdict").decode()
        if self.seat.leader and n > 2:  # every sibling is past round n - 2: forget it
            self.store.delete_key(f"{n - 2}/sum")
            self.store.delete_key(f"{n - 2}/verdict")
        return verdict == "ok"

"""Live recovery, the worker's side: regroup with the survivors, redo the step, go on.

    recovery = LiveRecovery.from_environment(config.launch)     # None unless --recovery live
    world = recovery.enter(world)                  # a worker started with the others
    recovery.join(state)                           # or: a replacement, built alone, healed
    fit(state, callbacks, recovery)                # steps and evaluations that survive a loss

[Note: live recovery] Under `--recovery live` the launcher (launcher.py) starts the
workers itself and hosts the store they meet in; a worker is a replica (one rank under DDP;
S ranks under ZeRO: [Note: HSDP replicas] in replica.py) and the run a sequence of generations
([Note: membership] in membership.py). Each step is guarded: when one of its collectives
fails (a peer died: gloo reports the closed connection at once; or a peer stalled: the group's
timeout is --collective-timeout, so the collective raises instead of waiting forever), this
replica
1. rewinds the step: it applied no update (under DDP every collective of a step comes before
   the optimizer's), so it drops the gradients and puts the data position back, and under
   --compress the compression state as it was at the step's start ([Note: compression across
   replicas] in compression/live.py);
2. leaves the broken group for a world of its own ([Note: abandoned groups] in groups.py),
   reports for the next generation and waits for the launcher's decision. A survivor blocked
   on another survivor rather than on the lost peer fails only at the collective timeout (gloo
   gives no way to cancel a wait), so the launcher waits that long, plus a grace, for every
   member;
3. forms the generation's process group (a new default gloo group on the store under
   gen/<g>/pg, [Note: quorum keys] in quorum.py) and moves the model to it
   (`dataparallel.rebind`: same state, new rank, new size, the mean's new divisor);
4. heals: if a member is behind or new, the source broadcasts its parameters, optimizer state,
   data position, counters and the compression state shared by all ranks (`snapshot` in
   rewind.py), and those members load them;
5. redoes the step with the whole global batch: the global batch is fixed for the run, and
   take_share splits it over the new size ([Note: uneven batches] in train/trainer.py), so the same
   samples are trained on and the gradient stays that of the global batch.
An evaluation interrupted the same way is redone after the regroup. Between steps each
member asks the store whether a replacement waits (`Quorum.regroup_asked`), and the members
agree on the answer in one small all-reduce, so that all of them regroup at the same step
boundary and the replacement is healed and trains from the next step. A replica that joins
from outside the launcher (`dataparallel join`, elastic.py) enters the same way; a member
released (`dataparallel leave`) reports LEAVE at that boundary instead of STEP, waits for the
generation formed without it, and ends (`Released`): nothing is rewound, nobody waits for a
timeout.
Under local SGD or DiLoCo step 1 goes back further, to the window's start, the steps since are
redone (`Rewound` tells the loop), and replicas are let in or out at the averager's boundaries
only ([Note: live averaging] in rewind.py).
"""

from __future__ import annotations

import enum
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import dataparallel as dp

from ...comm.plain import broadcast_plain
from ..config import LaunchConfig
from ..ledger import EvalRecord, StepRecord
from ..loop import Rewound, Steps
from ..state import TrainState
from ..trainer import evaluate, train_step
from .groups import Abandoned, move_to_world
from .membership import EVAL, JOIN, LEAVE, STEP, Membership, Report
from .quorum import Quorum
from .replica import ReplicaVote, Seat, SiblingFailed
from .rewind import Marks, healed_record, load_snapshot, snapshot
from .secret import RunKey
from .store import ENV_LIVE, client_store, group_prefix, run_store

# The launcher decides; if it dies, its workers die with it (worker.die_with_launcher).
DECISION_TIMEOUT_S = 3600.0


class Phase(enum.Enum):
    """Where a replica stands in its life cycle."""

    STARTING = "starting"  # not a member of any generation yet
    TRAINING = "training"  # a member of `LiveRecovery.membership`
    REGROUPING = "regrouping"  # reporting, waiting for the decision, forming the group, healing
    RELEASED = "released"  # let go by request (`dataparallel leave`): a member of no generation


class GroupNotFormed(RuntimeError):
    """A rank of the decided generation never came to form its group: regroup without it."""


class Dropped(RuntimeError):
    """This replica was dropped from a generation: it reported after the others had gone on
    (stalled)."""


class RegroupAsked(Exception):
    """The launcher asked the members to regroup at this step boundary: a replica waits to join,
    or a member was released."""


class Released(Exception):
    """This replica was released from the run at its request (`dataparallel leave`); the others
    go on."""


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because a peer is gone or stalled (gloo's
    closed connections and timeouts), not a fault of this process."""
    if isinstance(error, (dist.DistError, SiblingFailed, GroupNotFormed)):
        return True
    return isinstance(error, RuntimeError) and "gloo" in str(error)


def timed_out(error: BaseException) -> bool:
    """Whether a lost peer's `error` is a collective that waited out its timeout (a stalled
    peer) rather than one that failed at once (gloo's closed connection)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class LiveRecovery(Steps):
    """A replica's steps and evaluations, redone after a regroup ([Note: live recovery]).

    store: the launcher's store, under the run's prefix (`run_store`).
    slot: the slot of this worker's replica.
    joining: a replacement (built alone, then healed) rather than one of the first workers.
    timeout_s: --collective-timeout, the timeout of every generation's group.
    ranks: its index among the --shard-group processes of its replica ([Note: HSDP replicas]).
    owner: the pid the launcher knows the replica by, when not this process's (a replica
        joined with `dataparallel join` under --shard-group: the process that asked).
    key: the run's key, which seals its reports ([Note: signed requests] in secret.py); None
        only in the quorum's unit tests (the launcher refuses unsealed reports).
    """

    def __init__(
        self,
        store: dist.Store,
        slot: int,
        *,
        joining: bool,
        timeout_s: float,
        seat: Seat | None = None,
        owner: int | None = None,
        key: RunKey | None = None,
    ):
        self.store, self.slot, self.joining = store, slot, joining
        # This process's place in its replica, whose ranks agree on each attempt's outcome
        # ([Note: HSDP replicas] in replica.py).
        self.seat = seat or Seat()
        shard = self.seat.shard > 1
        self.vote = ReplicaVote(store, slot, self.seat, timeout_s) if shard else None
        self.pid = owner or os.getpid()  # the pid the launcher knows this replica by
        self.quorum = Quorum(store, slot, key=key)  # its reports sealed with the run's key
        self.timeout = timedelta(seconds=timeout_s)
        self.membership: Membership | None = None
        self.phase = Phase.STARTING
        self.healed_record: StepRecord | None = None
        self.abandoned = Abandoned(timeout_s)  # [Note: abandoned groups] in groups.py
        self.marks = Marks()  # where a failed step goes back to ([Note: live averaging])

    @classmethod
    def from_environment(cls, launch: LaunchConfig) -> LiveRecovery | None:
        """The recovery of a worker the live launcher started (ENV_LIVE), else None."""
        text = os.environ.get(ENV_LIVE)
        if not text:
            return None
        given = json.loads(text)
        store = run_store(client_store(given["store"]))
        seat = Seat(int(given.get("index", 0)), int(given.get("shard", 1)), given.get("start", 0))
        key = RunKey.read(Path(given["secret"]))  # [Note: signed requests] in secret.py
        return cls(
            store, int(given["replica"]), joining=bool(given["joining"]),
            timeout_s=launch.collective_timeout, seat=seat, owner=given.get("owner"), key=key,
        )  # fmt: skip

    # -- entering the run -----------------------------------------------------------------
    def enter(self, world: dp.World) -> dp.World:
        """One of the workers started together: meet the others in generation 0 and return the
        world of its group (the model is then built and broadcast as in any run)."""
        membership = self._meet(0, Report(replica=self.slot, step=0, pid=self.pid))
        world = self._form(world, membership)
        self.phase = Phase.TRAINING
        return world

    def alone(self, world: dp.World) -> dp.World:
        """A replacement's world before it is let in: itself, or its replica's S processes
        (an HSDP replica builds its state sharded as the others hold it)."""
        if self.seat.shard == 1:
            return world
        return self.seat.meet(self.store, self.timeout, world)

    def join(self, state: TrainState) -> None:
        """A replacement with its state built alone: wait to be let in at a step boundary,
        then receive the run's state from a member ([Note: live recovery])."""
        self._regroup(state, JOIN)

    # -- the guarded work (Steps) -------------------------------------------------------------
    def step(self, state: TrainState) -> StepRecord:
        self._check_training()
        before = state.step
        # [Note: HSDP replicas]: the vote before an update
        agree = self._agree if self.vote is not None else None
        while True:
            mark = self.marks.take(state)
            try:
                if self._at_boundary(state) and self._replacement_waits(state):
                    # Every member, the new one too, starts a step with this check.
                    raise RegroupAsked("a replica waits to join, or a member leaves")
                return train_step(state, agree)
            except Exception as error:
                asked = isinstance(error, RegroupAsked)
                if not asked and not lost_peer(error):
                    raise
                stalled = not asked and timed_out(error)
                if self.vote is not None and not isinstance(error, SiblingFailed):
                    self.vote(failed=True)  # its siblings learn it: all of them regroup
            if not asked:
                mark.rewind(state)
            self._regroup(state, STEP, stalled)
            if state.step < before:
                raise self._rewound(state, before)
            if state.step > before and self.healed_record is not None:
                return self.healed_record  # a member had finished the step: it is done

    def evaluate(self, state: TrainState) -> EvalRecord:
        self._check_training()
        before = state.step
        while True:
            try:
                record = evaluate(state)
                if self.vote is None or self.vote(failed=False):
                    return record
                raise SiblingFailed("a rank of this replica failed the evaluation's collective")
            except Exception as error:
                if not lost_peer(error):
                    raise
                stalled = timed_out(error)
                if self.vote is not None and not isinstance(error, SiblingFailed):
                    self.vote(failed=True)
            if state.averager is not None:  # the window is redone ([Note: live averaging])
                self.marks.take(state).rewind(state)
            self._regroup(state, EVAL, stalled)
            if state.step < before:
                raise self._rewound(state, before)

    def _rewound(self, state: TrainState, before: int) -> Rewound:
        """The members went back to the window's start ([Note: live averaging]); rank 0 says so."""
        if state.world.is_main:
            print(
                f"dataparallel train: live: a replica was lost at step {before}; the members "
                f"went back to step {state.step}, the last synchronisation, and redo the steps "
                "since",
                file=sys.stderr,
                flush=True,
            )
        return Rewound(state.step)

    def _agree(self) -> None:
        """Before the update (train_step's `before_update`): raises unless every rank of the
        replica got through."""
        if not self.vote(failed=False):
            raise SiblingFailed("a rank of this replica failed a collective of the step")

    def _at_boundary(self, state: TrainState) -> bool:
        """Where replicas may be let in: every step under DDP, an averager's boundaries."""
        return state.averager is None or state.averager.at_boundary()

    def _check_training(self) -> None:
        if self.phase is not Phase.TRAINING:
            raise RuntimeError(
                f"LiveRecovery: a step while {self.phase.value}; call enter() or join() first"
            )

    # -- the regroup --------------------------------------------------------------------------
    def _replacement_waits(self, state: TrainState) -> bool:
        """Whether the launcher asked this generation to let a replacement in, agreed by all
        members (one all-reduce of one number) so that all regroup at the same boundary."""
        asked = self.quorum.regroup_asked(self.membership.generation)
        if state.world.world_size == 1:
            return asked
        flag = torch.tensor([int(asked)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.world.group)
        return bool(flag.item())

    def _regroup(self, state: TrainState, where: str, stalled: bool = False) -> None:
        """Regroup until a generation has formed and healed: a member lost while this one
        regroups (the group's formation or the heal fails) makes it regroup again. stalled:
        the failed collective timed out (the report says so: `QuorumPolicy.grace_s`)."""
        self.phase = Phase.REGROUPING
        while True:
            failed = False
            try:
                self._regroup_once(state, where, stalled)
            except Exception as error:
                if not lost_peer(error):
                    raise
                stalled, failed = timed_out(error), True
            if self.vote is not None:  # a replica regroups again as a whole, never split
                failed = not self.vote(failed)
            if not failed:
                break
        self.phase = Phase.TRAINING

    def _regroup_once(self, state: TrainState, where: str, stalled: bool = False) -> None:
        if state.world.world_size > 1:  # a replacement starts alone: nothing to leave
            self._abandon(state)
        generation = self.membership.generation + 1 if self.membership else self.quorum.latest() + 1
        if where != JOIN and self.quorum.released():
            where = LEAVE
        membership = self._meet(
            generation,
            Report(
                replica=self.slot,
                step=state.step,
                where=where,
                pid=self.pid,
                timed_out=stalled,
            ),  # fmt: skip
        )
        state.world = self._form(state.world, membership)
        state.layout = state.layout.resized(state.world.world_size)  # [Note: layout]
        move_to_world(state, self.seat)
        self.marks.forget()
        self._heal(state, membership)
        state.ledger.forget_after(state.step)

    def _abandon(self, state: TrainState) -> None:
        """Abandon the broken group for a world of one, without waiting for it ([Note:
        abandoned groups] in groups.py)."""
        self.abandoned.keep(state)
        state.world = dp.regroup(dist.HashStore(), 0, 1, self.timeout, state.world)
        if self.seat.shard == 1:  # a sharded model waits for the next mesh as it is
            move_to_world(state, self.seat)

    def _meet(self, generation: int, report: Report) -> Membership:
        """Report for `generation` and wait for its decision; a replacement left out (the
        members were evaluating) tries the next one."""
        while True:
            if self.seat.leader:  # index 0 reports for its replica ([Note: HSDP replicas])
                self.quorum.report(generation, report)
            membership = self.quorum.wait(generation, DECISION_TIMEOUT_S)
            if self.slot in membership.members:
                return membership
            if report.where == LEAVE:
                self.phase = Phase.RELEASED
                raise Released(
                    f"replica {self.slot} left the run at step {report.step}; generation "
                    f"{generation} goes on without it"
                )
            if report.where != JOIN:
                raise Dropped(
                    f"replica {self.slot} was left out of generation {generation} (it "
                    "reported after the others had gone on: stalled)"
                )
            generation += 1

    def _form(self, world: dp.World, membership: Membership) -> dp.World:
        """Form `membership`'s group, once every rank of it has arrived ([Note: quorum keys])."""
        g = membership.generation
        store = dist.PrefixStore(group_prefix(g), self.store)
        rank, size = self.seat.rank(membership, self.slot), self.seat.size(membership)
        self.membership = membership  # a failed formation or heal regroups from here
        timeout_s = self.timeout.total_seconds()
        if not self.quorum.arrive(g, rank, size, timeout_s):
            raise GroupNotFormed(
                f"generation {g}: a rank did not come to form its group; timed out after "
                f"{timeout_s:g} s (lost after the decision)"
            )
        return dp.regroup(store, rank, size, self.timeout, world)

    def _heal(self, state: TrainState, membership: Membership) -> None:
        """The source's state to the members behind or new, in one broadcast."""
        self.healed_record = None
        if not membership.healed:
            return
        mine = snapshot(state) if self.slot == membership.source else None
        # By index: rank i of the source to rank i of the healed ([Note: HSDP replicas]).
        group = state.world.group if self.seat.shard == 1 else self.seat.heal_group(state)
        src = self.seat.heal_source(membership)
        # Tensors and JSON, never a pickle ([Note: nothing unpickled] in comm/plain.py).
        payload = broadcast_plain(mine, src=src, group=group)
        if self.slot in membership.healed:
            load_snapshot(state, payload)
            self.healed_record = healed_record(payload)

"""Live recovery, the worker's side: regroup with the survivors, redo the step, go on.

    recovery = LiveRecovery.from_environment(config.launch)     # None unless --recovery live
    world = recovery.enter(world)                  # a worker started with the others
    recovery.join(state)                           # or: a replacement, built alone, healed
    fit(state, callbacks, recovery)                # steps and evaluations that survive a loss

[Note: live recovery] Under `--recovery live` the launcher (train/live_launch.py) starts the
workers itself and hosts the store they meet in; a worker is a replica (one rank under DDP)
and the run a sequence of generations ([Note: membership] in comm/membership.py). Each step is
guarded: when one of its collectives fails (a peer died: gloo reports the closed connection at
once; or a peer stalled: the group's timeout is --collective-timeout, so the collective raises
instead of waiting forever), this replica
1. rewinds the step: it applied no update (under DDP every collective of a step comes before
   the optimizer's), so it drops the gradients and puts the data position back, and under
   --compress the compression state as it was at the step's start ([Note: compression across
   replicas] in compression/live.py);
2. leaves the broken group for a world of its own ([Note: abandoned groups]), reports for the
   next generation and waits for the launcher's decision. A survivor blocked on another
   survivor rather than on the lost peer fails only at the collective timeout (gloo gives no
   way to cancel a wait), so the launcher waits that long, plus a grace, for every member;
3. forms the generation's process group (a new default gloo group on the store under
   gen/<g>/pg, [Note: quorum keys] in comm/quorum.py) and moves the model to it
   (`dataparallel.rebind`: same state, new rank, new size, the mean's new divisor);
4. heals: if a member is behind or new, the source broadcasts its parameters, optimizer state,
   data position, counters and the compression state shared by all ranks (`snapshot`), and
   those members load them;
5. redoes the step with the whole global batch: the global batch is fixed for the run, and
   take_share splits it over the new size ([Note: uneven batches] in trainer.py), so the same
   samples are trained on and the gradient stays that of the global batch.
An evaluation interrupted the same way is redone after the regroup. Between steps each
member asks the store whether a replacement waits (`Quorum.regroup_asked`), and the members
agree on the answer in one small all-reduce, so that all of them regroup at the same step
boundary and the replacement is healed and trains from the next step. A replica that joins
from outside the launcher (`dataparallel join`, train/elastic.py) enters the same way; a member
let leave (`dataparallel leave`) reports LEAVE at that boundary instead of STEP, waits for the
generation formed without it, and ends (`Left`): nothing is rewound, nobody waits for a timeout.
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import dataparallel as dp

from ..comm.membership import EVAL, JOIN, LEAVE, STEP, Membership, Report
from ..comm.quorum import Quorum, client_store, group_prefix, run_store
from ..compression import CompressedHook
from ..compression.live import StepCopy, load_shared_state, shared_state
from .config import LaunchConfig
from .loop import Steps
from .records import EvalRecord, StepRecord
from .tensor_parallel import DataRanks
from .trainer import TrainState, evaluate, train_step

ENV_LIVE = "DATAPARALLEL_LIVE"  # {"store": "host:port", "replica": slot, "joining": bool}
# The launcher decides; if it dies, its workers die with it (worker.die_with_launcher).
DECISION_TIMEOUT_S = 3600.0


class Phase(enum.Enum):
    """Where a replica stands in its life cycle."""

    STARTING = "starting"  # not a member of any generation yet
    TRAINING = "training"  # a member of `LiveRecovery.membership`
    REGROUPING = "regrouping"  # reporting, waiting for the decision, forming the group, healing
    LEFT = "left"  # left the run by request: no longer a member of any generation


class LeftOut(RuntimeError):
    """This replica was left out of a generation (it reported too late: stalled)."""


class Left(Exception):
    """This replica left the run by request (`dataparallel leave`); the others go on."""


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because a peer is gone or stalled (gloo's
    closed connections and timeouts), not a fault of this process."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and "gloo" in str(error)


def timed_out(error: BaseException) -> bool:
    """Whether a lost peer's `error` is a collective that waited out its timeout (a stalled
    peer) rather than one that failed at once (gloo's closed connection)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@dataclass(frozen=True)
class Mark:
    """Where a step began, to rewind it.

    step: the step counter at the start.
    consumed: the data position at the start.
    skipped_steps: the count of skipped steps at the start.
    compression: the compression state at the start (`of` takes the copy), or None.
    """

    step: int
    consumed: int
    skipped_steps: int
    compression: StepCopy | None = None

    @classmethod
    def of(cls, state: TrainState, compression: StepCopy | None = None) -> Mark:
        if compression is not None:
            compression.take()
        return cls(state.step, state.samples.consumed, state.skipped_steps, compression)

    def rewind(self, state: TrainState) -> None:
        """Undo a step whose collectives failed: it applied no update; drop its gradients, put
        its samples back and the compression state as it was."""
        state.samples.consumed = self.consumed
        state.optimizer.zero_grad(set_to_none=True)
        if state.gradients is not None:
            state.gradients.nonfinite()  # forget the interrupted step's sums
        if self.compression is not None:
            self.compression.restore()


def compression_hook(state: TrainState) -> CompressedHook | None:
    """The run's compressed hook (--compress powersgd, topk, int8, fp8), else None."""
    hook = dp.strategy_of(state.model).stateful_hook()
    return hook if isinstance(hook, CompressedHook) else None


def snapshot(state: TrainState) -> dict:
    """What a healed replica receives: everything a step changes ([Note: live recovery])."""
    last = state.history[-1] if state.history and state.history[-1].step == state.step else None
    hook = compression_hook(state)
    return {
        "model": dp.full_state_dict(state.model),
        # Under DDP the optimizer is a plain torch one over the whole model, the same on every
        # replica, so its own state dict is exact.
        "optimizer": state.optimizer.state_dict(),
        "samples": state.samples.state_dict(),
        "step": state.step,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_record": last,
        "evals": state.evals[-1:],  # a replacement healed at step 0 skips the first evaluation
        # What every rank's compressor holds equal, not this rank's own residuals ([Note:
        # compression across replicas] in compression/live.py).
        "compression": shared_state(hook) if hook is not None else None,
        # The time the run has trained, so that a replacement's elapsed_s goes on from it (it
        # may write the records: [Note: the writer role] in writer.py).
        "elapsed_s": None if state.fit_started is None else time.perf_counter() - state.fit_started,
    }


def load_snapshot(state: TrainState, payload: dict) -> None:
    dp.load_full_state_dict(state.model, payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.samples.load_state_dict(payload["samples"])
    state.step = payload["step"]
    state.skipped_steps = payload["skipped_steps"]
    state.consecutive_skips = payload["consecutive_skips"]
    state.evals = state.evals or payload["evals"]
    hook = compression_hook(state)
    if (hook is None) != (payload["compression"] is None):
        raise ValueError(
            "live recovery: the source and this replica differ in --compress; every replica "
            "of a run uses the same one"
        )
    if hook is not None:
        load_shared_state(hook, payload["compression"])
    if payload["elapsed_s"] is not None:
        state.fit_started = time.perf_counter() - payload["elapsed_s"]


class LiveRecovery(Steps):
    """A replica's steps and evaluations, redone after a regroup ([Note: live recovery]).

    store: the launcher's store, under the run's prefix (`run_store`).
    replica: this worker's slot.
    joining: a replacement (built alone, then healed) rather than one of the first workers.
    timeout_s: --collective-timeout, the timeout of every generation's group.
    """

    def __init__(self, store: dist.Store, replica: int, *, joining: bool, timeout_s: float):
        self.store, self.replica, self.joining = store, replica, joining
        self.quorum = Quorum(store, replica)
        self.timeout = timedelta(seconds=timeout_s)
        self.membership: Membership | None = None
        self.phase = Phase.STARTING
        self.healed_record: StepRecord | None = None
        self.abandoned: list[dist.ProcessGroup] = []  # [Note: abandoned groups]
        self.compression: StepCopy | None = None  # the hook's state at the step's start

    @classmethod
    def from_environment(cls, launch: LaunchConfig) -> LiveRecovery | None:
        """The recovery of a worker the live launcher started (ENV_LIVE), else None."""
        text = os.environ.get(ENV_LIVE)
        if not text:
            return None
        given = json.loads(text)
        store = run_store(client_store(given["store"]))
        return cls(
            store, int(given["replica"]), joining=bool(given["joining"]),
            timeout_s=launch.collective_timeout,
        )  # fmt: skip

    # -- entering the run -----------------------------------------------------------------
    def enter(self, world: dp.World) -> dp.World:
        """One of the workers started together: meet the others in generation 0 and return the
        world of its group (the model is then built and broadcast as in any run)."""
        membership = self._meet(0, Report(replica=self.replica, step=0, pid=os.getpid()))
        world = self._form(world, membership)
        self.phase = Phase.TRAINING
        return world

    def join(self, state: TrainState) -> None:
        """A replacement with its state built alone: wait to be let in at a step boundary,
        then receive the run's state from a member ([Note: live recovery])."""
        self._regroup(state, JOIN)

    # -- the guarded work (Steps) -------------------------------------------------------------
    def step(self, state: TrainState) -> StepRecord:
        self._check_training()
        hook = compression_hook(state)
        if hook is not None and (self.compression is None or self.compression.hook is not hook):
            self.compression = StepCopy(hook)
        while True:
            mark = Mark.of(state, self.compression)
            try:
                if self._replacement_waits(state):
                    self._regroup(state, STEP)
                    continue  # every member, the new one too, starts a step with this check
                return train_step(state)
            except Exception as error:
                if not lost_peer(error):
                    raise
                stalled = timed_out(error)
            mark.rewind(state)
            self._regroup(state, STEP, stalled)
            if state.step > mark.step and self.healed_record is not None:
                return self.healed_record  # a member had finished the step: it is done

    def evaluate(self, state: TrainState) -> EvalRecord:
        self._check_training()
        while True:
            try:
                return evaluate(state)
            except Exception as error:
                if not lost_peer(error):
                    raise
                stalled = timed_out(error)
            self._regroup(state, EVAL, stalled)

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
            try:
                self._regroup_once(state, where, stalled)
                break
            except Exception as error:
                if not lost_peer(error):
                    raise
                stalled = timed_out(error)
        self.phase = Phase.TRAINING

    def _regroup_once(self, state: TrainState, where: str, stalled: bool = False) -> None:
        if state.world.world_size > 1:  # a replacement starts alone: nothing to leave
            self._leave(state)
        generation = self.membership.generation + 1 if self.membership else self.quorum.latest() + 1
        if where != JOIN and self.quorum.leaving():
            where = LEAVE
        membership = self._meet(
            generation,
            Report(
                replica=self.replica,
                step=state.step,
                where=where,
                pid=os.getpid(),
                timed_out=stalled,
            ),  # fmt: skip
        )
        state.world = self._form(state.world, membership)
        state.data = DataRanks(rank=state.world.rank, size=state.world.world_size)
        dp.rebind(state.model, state.world.group)
        self._heal(state, membership)

    def _leave(self, state: TrainState) -> None:
        """Leave the broken group for a world of one, without waiting for it.

        [Note: abandoned groups] A DDP step has several bucket all-reduces in flight; when one
        fails, the others are still pending on the gloo group's threads, and its destructor
        waits for them to time out (up to --collective-timeout). Freed here, that wait held
        this replica's report back until the launcher left it out as stalled (1 trial in 4).
        So the old group is kept in `abandoned`, unregistered and shut down but not freed;
        its pending work times out on its own threads while the run goes on.
        """
        self.abandoned.append(state.world.group)
        state.world = dp.join_group(dist.HashStore(), 0, 1, self.timeout, state.world)
        dp.rebind(state.model, state.world.group)

    def _meet(self, generation: int, report: Report) -> Membership:
        """Report for `generation` and wait for its decision; a replacement left out (the
        members were evaluating) tries the next one."""
        while True:
            self.quorum.report(generation, report)
            membership = self.quorum.wait(generation, DECISION_TIMEOUT_S)
            if self.replica in membership.members:
                return membership
            if report.where == LEAVE:
                self.phase = Phase.LEFT
                raise Left(
                    f"replica {self.replica} left the run at step {report.step}; generation "
                    f"{generation} goes on without it"
                )
            if report.where != JOIN:
                raise LeftOut(
                    f"replica {self.replica} was left out of generation {generation} (it "
                    "reported after the others had gone on: stalled)"
                )
            generation += 1

    def _form(self, world: dp.World, membership: Membership) -> dp.World:
        store = dist.PrefixStore(group_prefix(membership.generation), self.store)
        rank = membership.rank_of(self.replica)
        world = dp.join_group(store, rank, membership.size, self.timeout, world)
        self.membership = membership  # before healing: a failed heal regroups from here
        return world

    def _heal(self, state: TrainState, membership: Membership) -> None:
        """The source's state to the members behind or new, in one broadcast."""
        self.healed_record = None
        if not membership.healed:
            return
        payload = [snapshot(state) if self.replica == membership.source else None]
        dist.broadcast_object_list(
            payload, src=membership.rank_of(membership.source), group=state.world.group
        )
        if self.replica in membership.healed:
            load_snapshot(state, payload[0])
            self.healed_record = payload[0]["last_record"]

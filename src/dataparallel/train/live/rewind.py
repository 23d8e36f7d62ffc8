"""What a live replica goes back to when a peer is lost, and what a healed replica receives.

    mark = marks.take(state)          # before each step: a Mark (DDP) or the window's WindowMark
    mark.rewind(state)                # a collective failed: back to where the mark was taken
    payload = snapshot(state)         # the source of a heal ([Note: live recovery])
    load_snapshot(state, payload)     # a replica behind or new

[Note: live averaging] Under local SGD or DiLoCo a replica applies its own updates between
synchronisations, so a step whose collective fails cannot be undone by dropping its gradients:
the replica has moved since the last synchronisation on its own. What can be undone is the
*window*: at a boundary (`at_boundary()`: every replica's movement so far has been synchronised
and no reduction is in flight: under local SGD every H steps; under DiLoCo each step a
reduction is applied at, every step of the warm-up) the replica copies its whole state
(`WindowMark`: parameters, inner optimizer state, the averager's `state_dict()` and the
ledger, [Note: the ledger] in ledger.py), and when a peer is lost every survivor goes back to it,
the members regroup, and the steps since are redone by the survivors with the whole global batch
of each step. The lost replica's inner steps since the boundary are then trained on again by the
others: under local SGD and DiLoCo (F = 1, no overlap) no sample is lost or counted twice, and
the result is the run that had the smaller membership from the boundary on (exact up to the
summation order; tests/e2e/test_live_averaging.py). The loop learns of the rewind through
`Rewound` (train/loop.py): the records after the boundary are cut and written again.
Under Streaming DiLoCo the fragments' windows are staggered, so no boundary has every fragment
synchronised: going back to the last one (a fragment's), the lost replica's movement of the
other fragments since their own last synchronisation is lost (at most H - H / F of its steps,
on (F - 1) / F of the model); under overlap, its last tau steps before the boundary too.
A replica healed at a boundary (new, or behind: its synchronisation failed where the source's
had completed) takes the source's parameters, inner optimizer state and ledger, and the averager's
shared state (`shared()`: anchors, outer optimizer, schedule; [Note: averager state] in
averaging/local_sgd.py), then starts from the
anchors (DiLoCo: the source's own progress since is not its to keep; its own outer residuals are
kept, a new replica's are zero). A copy costs one model, its optimizer state and the anchors in
memory per replica, taken every boundary.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import dataparallel as dp

from ...compression import CompressedHook
from ...compression.live import StepCopy, load_shared_state, shared_state
from ..ledger import StepRecord
from ..state import TrainState


@dataclass(frozen=True)
class Mark:
    """Where a step began, to rewind it (DDP: the step applied no update before its
    collectives, [Note: live recovery] in recovery.py).

    ledger: the ledger at the start (`Ledger.state_dict`: the step, the data position, ...).
    compression: the compression state at the start (`of` takes the copy), or None.
    """

    ledger: dict
    compression: StepCopy | None = None

    @classmethod
    def of(cls, state: TrainState, compression: StepCopy | None = None) -> Mark:
        if compression is not None:
            compression.take()
        return cls(state.ledger.state_dict(), compression)

    def rewind(self, state: TrainState) -> None:
        """Undo a step whose collectives failed: it applied no update; drop its gradients, put
        its samples back and the compression state as it was."""
        state.ledger.rewind(self.ledger)
        state.optimizer.zero_grad(set_to_none=True)
        # A sharded optimizer steps pieces of flat shards: the model's own gradients that the
        # failed backward left (its buckets not reduced yet) would add to the redone ones.
        state.model.zero_grad(set_to_none=True)
        if state.gradients is not None:
            state.gradients.nonfinite()  # forget the interrupted step's sums
        if self.compression is not None:
            self.compression.restore()


def compression_hook(state: TrainState) -> CompressedHook | None:
    """The run's compressed hook (--compress powersgd, topk, int8, fp8), else None."""
    hook = dp.handle_of(state.model).stateful_hook()
    return hook if isinstance(hook, CompressedHook) else None


@dataclass(frozen=True)
class WindowMark:
    """A replica's whole state at an averager's boundary, copied ([Note: live averaging]).

    ledger: the ledger (`Ledger.state_dict`: the counters, the data position, the random state).
    model: the parameters (`full_state_dict`, copied).
    optimizer: the inner optimizer's state dict (copied).
    averager: the averager's `state_dict()` (copied).
    """

    ledger: dict
    model: dict
    optimizer: dict
    averager: dict

    @property
    def step(self) -> int:
        return self.ledger["step"]

    @classmethod
    def of(cls, state: TrainState) -> WindowMark:
        return cls(
            ledger=state.ledger.state_dict(),
            model={k: v.detach().clone() for k, v in dp.full_state_dict(state.model).items()},
            optimizer=copy.deepcopy(dp.local_optimizer_state_dict(state.optimizer)),
            averager=copy.deepcopy(state.averager.state_dict()),
        )

    def rewind(self, state: TrainState) -> None:
        """Back to the boundary: every update since is undone, the steps since are redone."""
        state.optimizer.zero_grad(set_to_none=True)
        state.model.zero_grad(set_to_none=True)
        if state.gradients is not None:
            state.gradients.nonfinite()
        dp.load_full_state_dict(state.model, self.model)
        dp.load_local_optimizer_state_dict(state.optimizer, copy.deepcopy(self.optimizer))
        state.averager.load_state_dict(copy.deepcopy(self.averager))
        state.ledger.rewind(self.ledger)


class Marks:
    """The mark a step starts from: a fresh `Mark` under DDP; under an averager the window's
    `WindowMark`, taken at each boundary and kept until the next ([Note: live averaging])."""

    def __init__(self):
        self.window: WindowMark | None = None
        self.compression: StepCopy | None = None  # the hook's state at the step's start

    def take(self, state: TrainState) -> Mark | WindowMark:
        if state.averager is None:
            hook = compression_hook(state)
            if hook is not None and (self.compression is None or self.compression.hook is not hook):
                self.compression = StepCopy(hook)
            return Mark.of(state, self.compression)
        if state.averager.at_boundary() and (self.window is None or self.window.step != state.step):
            self.window = WindowMark.of(state)
        if self.window is None:
            raise RuntimeError("Marks: a live replica under an averager began off a boundary")
        return self.window

    def forget(self) -> None:
        """After a regroup: the state may have been healed; the next step marks it again."""
        self.window = None


def snapshot(state: TrainState) -> dict:
    """What a healed replica receives: everything a step changes ([Note: live recovery])."""
    ledger = state.ledger
    last = ledger.history[-1] if ledger.history and ledger.history[-1].step == state.step else None
    hook = compression_hook(state)
    return {
        "model": dp.full_state_dict(state.model),
        # Under DDP (and inside each replica under an averager) the optimizer is a plain torch
        # one over the whole model, so its own state dict is exact; under ZeRO inside HSDP
        # replicas it is this rank's shard's, exact for the rank of the same index.
        "optimizer": dp.local_optimizer_state_dict(state.optimizer),
        "averager": state.averager.shared() if state.averager is not None else None,
        # The counters, the data position, the random state, the last evaluation (a
        # replacement healed at step 0 skips the first one) and the time the run has trained,
        # so that a replacement's elapsed_s goes on from it (it may write the records: [Note:
        # the writer role] in writer.py).
        "ledger": ledger.state_dict(),
        "last_record": dataclasses.asdict(last) if last is not None else None,
        # What every rank's compressor holds equal, not this rank's own residuals ([Note:
        # compression across replicas] in compression/live.py).
        "compression": shared_state(hook) if hook is not None else None,
    }


def healed_record(payload: dict) -> StepRecord | None:
    """The source's record of the step it had finished, if it had (a heal mid-step)."""
    last = payload["last_record"]
    return StepRecord(**last) if last is not None else None


def load_snapshot(state: TrainState, payload: dict) -> None:
    dp.load_full_state_dict(state.model, payload["model"])
    dp.load_local_optimizer_state_dict(state.optimizer, payload["optimizer"])
    if state.averager is not None:
        state.averager.adopt(payload["averager"])  # [Note: live averaging]
    state.ledger.load_state_dict(payload["ledger"])
    hook = compression_hook(state)
    if (hook is None) != (payload["compression"] is None):
        raise ValueError(
            "live recovery: the source and this replica differ in --compress; every replica "
            "of a run uses the same one"
        )
    if hook is not None:
        load_shared_state(hook, payload["compression"])

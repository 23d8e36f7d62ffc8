"""The hooks the loop calls: what logging, checkpointing, tracing and reports plug into.

Below the loop (loop.py) so that what plugs in depends on the run's state and records only,
never on the loop or the trainer.
"""

from __future__ import annotations

from .ledger import EvalRecord, StepRecord
from .state import TrainState


class Callback:
    """Hooks the loop calls on every rank; override what you need (all default to nothing).

    Callbacks run in the order given. Collective work (a checkpoint gathers shards) must be done
    by a callback present on every rank; logging callbacks are usually given to rank 0 only.
    """

    def on_start(self, state: TrainState) -> None: ...

    def on_step(self, state: TrainState, record: StepRecord) -> None: ...

    def on_skip(self, state: TrainState, record: StepRecord) -> None:
        """A step skipped on every rank (overflow, or a non-finite loss or gradient)."""

    def on_eval(self, state: TrainState, record: EvalRecord) -> None: ...

    def on_rewind(self, state: TrainState) -> None:
        """The run went back to `state.step` (a live run under an averager lost a replica:
        [Note: live averaging] in live/rewind.py); the steps after it are redone and recorded
        again."""

    def on_leave(self, state: TrainState) -> None:
        """This process left a live run by request (`dataparallel leave`); the others go on."""

    def on_end(self, state: TrainState) -> None: ...

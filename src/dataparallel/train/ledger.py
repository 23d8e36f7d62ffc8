"""A run's ledger: how far it has got, one record that checkpoints, rewinds and heals share,
and the records it keeps of each optimizer step (StepRecord) and validation pass (EvalRecord).

    saved = state.ledger.state_dict()       # plain values (JSON): step, skips, data position...
    state.ledger.load_state_dict(saved)     # a resume (checkpointing.py), a heal (live/rewind.py)
    state.ledger.rewind(saved)              # a failed step or window goes back (live/rewind.py)

[Note: the ledger] Everything a step or an evaluation moves on, and nothing that is built once:
the step, the skipped steps, the non-finite steps in a row, the data position, torch's random
state (dropout draws the same numbers when a step is redone or a run resumed), the last
evaluation (a member healed at step 0 skips the first one) and the time the run has trained.
A checkpoint stores its state dict under "ledger" (checkpointing.py reads the older layout
too), a rewind's mark keeps one (live/rewind.py's Mark and WindowMark), a heal sends one
(live/rewind.py's `snapshot`). A rewind goes back in steps, not in time: it keeps the clock; a resume
and a heal take the writer's, so that the run's elapsed_s goes on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..data.stream import SampleStream


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one optimizer step produced; callbacks get it on every rank.

    step: optimizer steps done, counting this one (1 after the first update).
    loss: the step's training loss (see [Note: loss normalisation]), the same on every rank.
    lr: learning rate of this update.
    grad_norm: global L2 norm of the gradient before clipping.
    tokens: target tokens in the global batch.
    step_time_s: wall time of the step (data, forward, backward, communication, update).
    elapsed_s: wall time since `fit` began.
    loss_scale: the loss scaler's scale after this step (`--precision fp16`), else 1.
    skipped_steps: steps of this session whose gradients overflowed and were skipped on every
        rank (they do not count in `step`, nor move the LR schedule).
    bytes_sent: bytes this rank handed to the strategy's and the averager's collectives in this
        step (payload sizes; compression shrinks them).
    wire_bytes: bytes this rank put on its links for them in this step, from each collective's
        algorithm ([Note: bytes on the wire] in comm/wire.py): what crosses the network.
    rank_step_s: each rank's work time in this step (data, forward, backward, less the time it
        waited in collectives), in rank order ([Note: blame] in blame.py).
    nonfinite_ranks: for a step skipped for a non-finite loss or gradient, the ranks whose own
        loss or gradients were not finite before the reduction; else ().
    """

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_time_s: float
    elapsed_s: float
    loss_scale: float = 1.0
    skipped_steps: int = 0
    bytes_sent: int = 0
    wire_bytes: int = 0
    rank_step_s: tuple[float, ...] = ()
    nonfinite_ranks: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """One validation pass.

    step: optimizer steps done when it ran (0 is the untrained model).
    val_loss: mean token cross-entropy over all scored validation windows, across all ranks.
    tokens: target tokens scored.
    eval_time_s: wall time of the pass.
    """

    step: int
    val_loss: float
    tokens: int
    eval_time_s: float


@dataclass(kw_only=True)
class Ledger:
    """How far a run has got ([Note: the ledger]; mutable: every step moves it on).

    samples: the data position, in global samples ([Note: global sample position]).
    step: optimizer steps done (the learning rate is a pure function of it).
    skipped_steps: steps skipped on every rank (overflow, or a non-finite loss or gradient).
    consecutive_skips: non-finite steps in a row ([Note: non-finite steps] in blame.py).
    history: the StepRecords of this session (a rewind cuts those after its step).
    evals: the EvalRecords of this session.
    fit_started: time.perf_counter() when `fit` began, which elapsed_s counts from (None
        before); a resume or a heal moves it back by the run's elapsed time.
    """

    samples: SampleStream
    step: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    history: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    fit_started: float | None = None

    def elapsed(self) -> float | None:
        """Seconds the run has trained (None before `fit` began)."""
        return None if self.fit_started is None else time.perf_counter() - self.fit_started

    def count(self, skipped: bool, nonfinite: bool) -> None:
        """A step done: one more step, or one more skipped (in a row if non-finite)."""
        if skipped:
            self.skipped_steps += 1
        else:
            self.step += 1
        self.consecutive_skips = self.consecutive_skips + 1 if nonfinite else 0

    def state_dict(self) -> dict:
        """The ledger as plain values (JSON), copied: nothing in it changes with the ledger.
        The random state is torch's CPU generator's, and the current CUDA device's when CUDA
        is in use (dropout on a GPU draws from it), as hex."""
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "samples": dict(self.samples.state_dict()),
            "rng": _hex(torch.random.get_rng_state()),
            "cuda_rng": _hex(torch.cuda.get_rng_state()) if torch.cuda.is_initialized() else None,
            "evals": [dataclasses.asdict(record) for record in self.evals[-1:]],
            "elapsed_s": self.elapsed(),
        }

    def load_state_dict(self, saved: dict) -> None:
        """Continue from `saved` (a resume, a heal); the clock too, when it had started."""
        self.rewind(saved)
        if saved["elapsed_s"] is not None:
            self.fit_started = time.perf_counter() - saved["elapsed_s"]

    def rewind(self, saved: dict) -> None:
        """Go back to `saved`, keeping the clock: the records after its step are cut, and its
        evaluation is taken only by a ledger that has none (a member healed at step 0)."""
        self.samples.load_state_dict(saved["samples"])
        self.step = int(saved["step"])
        self.skipped_steps = int(saved["skipped_steps"])
        self.consecutive_skips = int(saved["consecutive_skips"])
        torch.random.set_rng_state(_bytes(saved["rng"]))
        if saved.get("cuda_rng") and torch.cuda.is_initialized():  # absent before it was kept
            torch.cuda.set_rng_state(_bytes(saved["cuda_rng"]))
        self.evals = self.evals or [EvalRecord(**record) for record in saved["evals"]]
        self.forget_after(self.step)

    def forget_after(self, step: int) -> None:
        """Drop the session's records after `step` (steps a rewind undid: they are redone)."""
        self.history = [r for r in self.history if r.step <= step]
        self.evals = [r for r in self.evals if r.step <= step]


def _hex(state: torch.Tensor) -> str:
    return state.numpy().tobytes().hex()


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(text), dtype=torch.uint8)

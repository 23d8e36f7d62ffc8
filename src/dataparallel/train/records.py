"""What the training loop reports: one record per optimizer step and per validation pass."""

from __future__ import annotations

from dataclasses import dataclass


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

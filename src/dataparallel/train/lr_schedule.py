"""The learning-rate schedule: optional linear scaling of the peak, linear warm-up, cosine decay.

The schedule is a pure function of the step: the trainer sets each param group's lr to
peak x schedule(step) before every update, so restoring the step on --resume restores the
learning rate exactly (there is no scheduler object whose state could drift).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def scaled_lr(lr: float, global_batch: int, *, scaling: str, base_batch: int) -> float:
    """The peak learning rate for `global_batch`.

    scaling "linear" multiplies `lr` (tuned at `base_batch`) by global_batch / base_batch: with
    k times the batch, one step averages k times as many samples, so its gradient is less noisy
    and can take a k times larger step (Goyal et al., 2017). "none" returns `lr`.
    """
    if scaling == "none":
        return lr
    if scaling == "linear":
        if base_batch < 1:
            raise ValueError(f"base_batch={base_batch} must be >= 1 for linear scaling")
        return lr * global_batch / base_batch
    raise ValueError(f"scaling={scaling!r} must be 'none' or 'linear'")


@dataclass(frozen=True, kw_only=True)
class WarmupCosine:
    """Multiplier of the peak learning rate at each step (it also works as a LambdaLR
    `lr_lambda`).

    warmup_steps: steps of linear warm-up; step s < warmup_steps gets (s + 1) / warmup_steps,
        so the first update already moves (a factor of 0 would waste a step).
    total_steps: the step at which the cosine reaches `min_ratio` (the run's last step).
    min_ratio: the floor of the decay, as a fraction of the peak.
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __post_init__(self):
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"WarmupCosine: warmup_steps={self.warmup_steps} must be >= 0 and "
                f"total_steps={self.total_steps} >= 1"
            )
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"WarmupCosine: min_ratio={self.min_ratio} must be in [0, 1]")

    def __call__(self, step: int) -> float:
        """The factor for the update that ends step `step + 1` (steps count from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * cosine

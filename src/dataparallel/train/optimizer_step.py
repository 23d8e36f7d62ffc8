"""The end of a step: clip, step the optimizer or skip the step ([Note: non-finite steps])."""

from __future__ import annotations

import math

import dataparallel as dp


def clip_and_step(state, total_loss: float) -> tuple[float, bool, bool]:
    """Clip, step and zero the gradients; return the norm before clipping, whether the step
    was skipped, and whether it was skipped for a non-finite loss or gradient.

    [Note: non-finite steps] A step whose global loss or gradient norm is not finite is skipped
    on every rank together: both numbers are all-reduced, so every rank sees the same verdict,
    and no rank steps its optimizer (the gradients are dropped, the data moves on, the step
    count and the schedule stay). Under fp16 the loss scaler's own overflow skip is the usual
    case and is not counted as a fault unless the loss itself is not finite. After
    `train.max_skips` faulty steps in a row, `fit` stops the run (FloatingPointError) without
    writing a checkpoint, so the last complete one is the last good state.
    """
    config, model, scaler = state.config, state.model, state.scaler
    max_norm = config.optim.grad_clip if config.optim.grad_clip > 0 else math.inf
    if scaler is not None:
        scaler.unscale_(state.optimizer)  # clip the true gradients
    grad_norm = float(dp.clip_grad_norm_(model, max_norm))
    bad_loss = not math.isfinite(total_loss)
    if scaler is not None:
        # Every rank agrees on an overflow ([Note: found inf]), so all skip or all step.
        before = scaler.get_scale()
        scaler.step(state.optimizer)
        scaler.update()
        skipped, nonfinite = scaler.get_scale() < before, bad_loss
    elif bad_loss or not math.isfinite(grad_norm):
        skipped = nonfinite = True
    else:
        state.optimizer.step()
        skipped = nonfinite = False
    state.optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped, nonfinite

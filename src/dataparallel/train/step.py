"""The concerns of one training step, in order: its data, its loss, this rank's own verdict,
the vote and the update (train_step in trainer.py runs them; [Note: loss
normalisation] and [Note: uneven batches] there).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

import dataparallel as dp

from ..data.packing import IGNORE
from ..data.stream import split_evenly
from .loss import all_reduce_sum, token_loss_sum
from .optimizer_step import clip_and_step
from .state import TrainState


@dataclass(frozen=True)
class Batch:
    """A step's data on this rank ([Note: uneven batches]).

    micro: its `accum` micro-batches, (inputs, targets) each.
    global_tokens: the targets the loss counts, over every rank ([Note: loss normalisation]).
    scale: what each rank multiplies its token-loss sum by, dp size / global tokens.
    """

    micro: list[tuple[torch.Tensor, torch.Tensor]]
    global_tokens: float
    scale: float


def take_batch(state: TrainState) -> Batch:
    """This rank's share of the step's samples, in micro-batches, and the global token count
    (one all-reduce); the ledger's data position moves on by the global batch."""
    size = state.layout.data_size  # [Note: layout]: the dp ranks under --tp
    indices = state.ledger.samples.take_share(state.global_batch, state.data_rank, size)
    parts = split_evenly(indices, state.config.train.accum)
    micro = [state.train_windows.batch(part) for part in parts]
    local_tokens = sum(int((targets != IGNORE).sum()) for _, targets in micro)
    (global_tokens,) = all_reduce_sum([local_tokens * state.loss_weight], state.world, state.tracer)
    # [Note: loss normalisation]; a step of prompts only counts 0 tokens: a zero gradient
    return Batch(micro, global_tokens, size / max(global_tokens, 1))


def set_lr(state: TrainState) -> float:
    """The schedule's learning rate at the ledger's step, set on every parameter group."""
    lr = state.peak_lr * state.schedule(state.step)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    return lr


def forward_backward(state: TrainState, batch: Batch) -> torch.Tensor:
    """The micro-steps: forward, backward (the last one's reduces); this rank's summed token
    loss, in float64."""
    model, device, trace, scaler = state.model, state.world.device, state.tracer, state.scaler
    accum = state.config.train.accum
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for k, (inputs, targets) in enumerate(batch.micro):
        # Every micro-step but the last accumulates locally; the last one's backward reduces.
        sync = contextlib.nullcontext() if k == accum - 1 else dp.no_sync(model)
        with sync:
            with trace.span("forward", micro=k):
                summed = token_loss_sum(state, inputs.to(device), targets.to(device))
                loss = summed * batch.scale
            with trace.span("backward", micro=k):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += summed.detach().double()
    return loss_sum


def own_verdict(state: TrainState, loss_sum: torch.Tensor) -> bool:
    """Whether this rank's own loss or gradients are not finite, before any reduction
    ([Note: blame]); the gradient watch is asked every step: it starts the next."""
    bad = not math.isfinite(float(loss_sum))
    if state.gradients is not None:
        bad = state.gradients.nonfinite() or bad
    return bad


@dataclass(frozen=True)
class Vote:
    """What one all-reduce tells every rank: the step's summed loss, each rank's work time
    and each rank's own verdict ([Note: blame]).

    loss: the global token-loss sum.
    rank_step_s: each rank's work time, in rank order.
    bad_ranks: the ranks whose own loss or gradients were not finite.
    """

    loss: float
    rank_step_s: tuple[float, ...]
    bad_ranks: tuple[int, ...]

    @classmethod
    def of(cls, state: TrainState, loss_sum: torch.Tensor, work_s: float, bad: bool) -> Vote:
        world = state.world
        with state.tracer.span("loss"):  # each rank's time and verdict in its own slots
            sums = all_reduce_sum(
                [
                    float(loss_sum) * state.loss_weight,
                    *_slot(work_s, world),
                    *_slot(float(bad), world),
                ],
                world,
                state.tracer,
            )
        size = world.world_size
        bad_ranks = tuple(r for r, b in enumerate(sums[1 + size :]) if b)
        return cls(sums[0], tuple(sums[1 : 1 + size]), bad_ranks)


def update(state: TrainState, total_loss: float) -> tuple[float, bool, bool]:
    """Clip and step the optimizer or skip the step ([Note: non-finite steps]), then the
    averager after a step taken; (the norm before clipping, skipped, skipped as non-finite)."""
    with state.tracer.span("optimizer"):
        grad_norm, skipped, nonfinite = clip_and_step(state, total_loss)
    if state.averager is not None and not skipped:
        with state.tracer.span("averager"):
            state.averager.step()  # every H steps: synchronise the replicas' parameters
            if state.step + 1 == state.config.train.steps:
                state.averager.finish()  # DiLoCo: the run ends on one model
    return grad_norm, skipped, nonfinite


def _slot(value: float, world: dp.World) -> list[float]:
    """`value` in this rank's place of a vector of world size zeros (summed: every rank's)."""
    return [value if rank == world.rank else 0.0 for rank in range(world.world_size)]

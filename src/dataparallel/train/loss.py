"""The step's sums: each rank's token-loss sum, and the few numbers the ranks add up
([Note: loss normalisation] in trainer.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn import functional as F

import dataparallel as dp

from ..comm.progress import watched
from ..data.packing import IGNORE


def all_reduce_sum(values: list[float], world: dp.World, tracer=None) -> list[float]:
    """Sum a few numbers over all ranks (float64, so token counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)  # NCCL: on the GPU
    if world.world_size > 1:
        # Not the strategy's traffic (not in bytes_sent), but the training thread waits on it.
        with tracer.span("wait", "blocked", kind="all_reduce") if tracer else NO_SPAN:
            with watched(world.group, "all_reduce", tensor, what="trainer sums"):  # watchdog
                dist.all_reduce(tensor, group=world.group)
    return tensor.tolist()


NO_SPAN = contextlib.nullcontext()


def autocast(state):
    return state.composed.autocast() if state.composed is not None else NO_SPAN


def token_loss_sum(state, inputs: torch.Tensor, targets: torch.Tensor):
    with autocast(state):
        logits = state.model(inputs)
    logits = getattr(logits, "logits", logits)  # a Hugging Face model's output holds them
    # The loss in fp32 even under bf16 autocast: a sum over thousands of tokens.
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )

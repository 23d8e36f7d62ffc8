"""ZeRO-3 trained side by side with our DDP and one process on the global batch, for the ZeRO-3
test files (test_zero3.py, test_zero3_grouped.py)."""

from __future__ import annotations

import torch

import dataparallel as dp

from .models import OPTIMIZERS, accumulate, batch, build, loss_fn, reference_loss

STEPS = 10
PER_RANK = 4
TOL = 1e-5  # max |ours - reference| over every element of every parameter


def max_diff(state: dict, other: dict) -> float:
    return max((state[k].float() - other[k].float()).abs().max().item() for k in other)


def train_case(
    world, model_name, opt_name, policy, accum=1, clip=None, autocast=False, pairwise=None
):
    """Train ZeRO-3, our DDP and one process on the global batch side by side.

    Returns max |zero3 - reference| and max |zero3 - ddp| over all weights after STEPS steps.
    """
    rank, n = world.rank, world.world_size
    cls, kwargs = OPTIMIZERS[opt_name]
    # rank 0's weights win
    ours = dp.parallelize(build(model_name, seed=100 + rank), policy, pairwise=pairwise)
    ddp = dp.parallelize(build(model_name, seed=100 + rank), dp.DDP())
    reference = build(model_name, seed=100)
    runs = [(m, dp.build_optimizer(m, cls, **kwargs)) for m in (ours, ddp)]
    ref_opt = cls([p for p in reference.parameters() if p.requires_grad], **kwargs)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    for step in range(STEPS):
        x, y = batch(model_name, step, PER_RANK * n * accum)
        with amp:
            loss = reference_loss(model_name, reference, x, y, step, n)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        xs, ys = x.chunk(n)[rank].chunk(accum), y.chunk(n)[rank].chunk(accum)
        for model, opt in runs:

            def loss_of(micro, model=model):
                with amp:
                    return loss_fn(model_name, model, xs[micro], ys[micro], step, rank)

            accumulate(model, loss_of, accum)
            if clip is not None:
                dp.clip_grad_norm_(model, clip)
            opt.step()
            opt.zero_grad()
    state = dp.full_state_dict(ours)
    return {
        "vs_reference": max_diff(state, reference.state_dict()),
        "vs_ddp": max_diff(state, ddp.state_dict()),
    }

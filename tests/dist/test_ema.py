"""An EMA of the weights on every strategy, against PyTorch's recipe on one process.

One process: `AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))`, updated after
each step. Under DDP and ZeRO-1/2 the same recipe runs on the parallelized model (its
deepcopy is a plain module: [Note: model copies]); under ZeRO-3 that copy is refused in one
line, and `dp.EMA` ([Note: sharded EMA]) gives the same average on every strategy. Both within
1e-5 of one process's EMA; `dp.EMA.applied` puts the average in the model and gives the
weights back exactly; its state dict moves between strategies.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dataparallel as dp

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss

STEPS, PER_RANK, MODEL, SEED, DECAY = 6, 4, "transformer", 3, 0.9
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
SMALL = {"bucket_mb": 0.02, "first_bucket_mb": 0.002}  # several buckets: shards straddle params
TOL = 1e-5
POLICIES = {
    "ddp": lambda: dp.DDP(**SMALL),
    "zero1": lambda: dp.ZeRO1(**SMALL),
    "zero1-overlap": lambda: dp.ZeRO1(**SMALL, overlap_param_gather=True),
    "zero2": lambda: dp.ZeRO2(**SMALL),
    "zero3": lambda: dp.ZeRO3(),
}


def _diff(state: dict, reference: dict) -> float:
    return max((state[k].float() - v.float()).abs().max().item() for k, v in reference.items())


def _plain(module) -> bool:
    """No strategy and no hooks anywhere: a plain module."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
    try:
        dp.handle_of(module)
    except ValueError:
        return hooks == 0 and all(p.grad is None for p in module.parameters())
    return False


def ema_grid(world) -> dict:
    n, rank = world.world_size, world.rank
    reference = build(MODEL, SEED)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    models, opts, emas, averaged, out = {}, {}, {}, {}, {}
    for name, policy in POLICIES.items():
        models[name] = dp.parallelize(build(MODEL, SEED), policy())
        opts[name] = dp.build_optimizer(models[name], torch.optim.AdamW, **ADAMW)
        emas[name] = dp.EMA(models[name], DECAY)
        if name == "zero3":
            with pytest.raises(ValueError) as refused:
                copy.deepcopy(models[name])
            out["zero3-refusal"] = str(refused.value)
            continue
        averaged[name] = AveragedModel(models[name], multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        out[f"{name}-plain"] = _plain(averaged[name].module)
    applied = {}
    for step in range(STEPS):
        x, y = batch(MODEL, step, PER_RANK * n)
        reference_loss(MODEL, reference, x, y, step, n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_ema.update_parameters(reference)
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        for name, model in models.items():
            loss_fn(MODEL, model, *mine, step, rank).backward()
            opts[name].step()
            opts[name].zero_grad()
            emas[name].update()
            if name in averaged:
                dp.finish_param_gather(model)  # AveragedModel reads the parameters itself
                averaged[name].update_parameters(model)
            if step == STEPS // 2:  # an evaluation with the average, mid-run
                before = dp.full_state_dict(model)
                with emas[name].applied():
                    inside = dp.full_state_dict(model)
                after = dp.full_state_dict(model)
                applied[name] = (
                    _diff(inside, emas[name].full_state_dict()),
                    _diff(after, before),
                )
    for name in averaged:  # right after a step: under overlap, its gathers are in flight
        copied = copy.deepcopy(models[name]).state_dict()
        out[f"{name}-copy"] = _diff(copied, dp.full_state_dict(models[name]))
    ema_state = {k: v.detach() for k, v in ref_ema.module.state_dict().items()}
    out["lag"] = _diff(ema_state, reference.state_dict())  # how far the average trails
    for name, model in models.items():
        out[name] = {
            "ema": _diff(emas[name].full_state_dict(), ema_state),
            "applied": applied[name],
            "trained": _diff(dp.full_state_dict(model), reference.state_dict()),
        }
        if name in averaged:
            out[name]["averaged_model"] = _diff(averaged[name].module.state_dict(), ema_state)
    moved = dp.EMA(models["zero3"], DECAY)  # a checkpointed EMA into another strategy
    moved.load_state_dict(emas["zero1"].state_dict())
    out["moved"] = _diff(moved.full_state_dict(), emas["zero1"].full_state_dict())
    return out


def test_ema_on_every_strategy_equals_one_process():
    results = run_world(2, ema_grid)
    out = results[0]
    assert out["zero3-refusal"] == results[1]["zero3-refusal"]
    refusal = out["zero3-refusal"]
    assert "\n" not in refusal and "dataparallel.EMA(model, decay)" in refusal, refusal
    cases = 0
    for name in POLICIES:
        got = out[name]
        assert got["trained"] < TOL, (name, got)  # the premise: it trains as one process
        assert got["ema"] < TOL, (name, got)
        assert got["applied"] == (0.0, 0.0), (name, got)  # the average in, the weights back
        if name != "zero3":
            assert out[f"{name}-plain"], name
            assert out[f"{name}-copy"] == 0.0, name  # the whole current weights
            assert got["averaged_model"] < TOL, (name, got)
        cases += 1
    assert cases == len(POLICIES) == 5
    assert out["moved"] == 0.0
    assert out["lag"] > 1e-2  # the average is not the weights: the test can tell them apart

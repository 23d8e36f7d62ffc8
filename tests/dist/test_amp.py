"""PyTorch's AMP recipe for fp16, unmodified, on every strategy across 2 ranks.

fp32 parameters, `torch.autocast(dtype=torch.float16)`, a default `torch.amp.GradScaler` and
AdamW, with the AMP docs' gradient clipping (`scaler.unscale_(opt)`, then the global-norm clip)
at a bound the true norm never reaches, so clipping changes nothing in one process. The clip is
PyTorch's `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` everywhere (under ZeRO the
model's `.grad` read the reduced gradient where it lives, [Note: sharded gradients];
tests/dist/test_grad_access.py), and `dp.clip_grad_norm_(model, ...)` in a third run. ZeRO-1
used to keep its shard's gradient in the very memory its model `.grad` view, and PyTorch's
clip, reading this rank's still-scaled local sums there, shrank each rank's shard by its own
factor: 6e-2 from one process where PyTorch's DDP is 2.8e-4 ([Note: consumed sums]). Bound: fp16 rounds the chunked forward differently from the one-process forward, so
PyTorch's DDP sits a little away from one process; each of ours must be within 1.5 times that.
Natural overflows at the default scale: tests/dist/test_amp_overflow.py.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

import dataparallel as dp

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss

STEPS, PER_RANK, MODEL, SEED = 8, 4, "transformer", 7
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CLIP = 100.0  # far above the true norm (~1): the clip is the recipe's, not a change
SMALL = {"bucket_mb": 0.02, "first_bucket_mb": 0.002}  # a few buckets: shards straddle params
SLACK = 1.5


def _torch_clip(model) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)


def _our_clip(model) -> None:
    dp.clip_grad_norm_(model, CLIP)


def _step(model, opt, scaler, loss, clip) -> None:
    scaler.scale(loss.float()).backward()
    if clip is not None:
        scaler.unscale_(opt)
        clip(model)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def recipe(world, clip: str | None) -> dict[str, float]:
    """max |theirs - one process| over every parameter after STEPS steps, per strategy."""
    n, rank = world.world_size, world.rank
    reference = build(MODEL, SEED)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    models, opts = {}, {}
    policies = {
        "ddp": dp.DDP(**SMALL),
        "zero1": dp.ZeRO1(**SMALL),
        "zero2": dp.ZeRO2(**SMALL),
        "zero3": dp.ZeRO3(),
    }
    for name, policy in policies.items():
        models[name] = dp.parallelize(build(MODEL, SEED), policy)
        opts[name] = dp.build_optimizer(models[name], torch.optim.AdamW, **ADAMW)
    models["torch-ddp"] = DistributedDataParallel(build(MODEL, SEED))
    opts["torch-ddp"] = torch.optim.AdamW(models["torch-ddp"].parameters(), **ADAMW)
    scalers = {name: torch.amp.GradScaler("cpu") for name in ["one", *models]}
    for step in range(STEPS):
        x, y = batch(MODEL, step, PER_RANK * n)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference_loss(MODEL, reference, x, y, step, n)
        _step(reference, ref_opt, scalers["one"], loss, _torch_clip if clip else None)
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        for name, model in models.items():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(MODEL, model, *mine, step, rank)
            ours = clip == "ours" and name != "torch-ddp"
            clipper = (_our_clip if ours else _torch_clip) if clip else None
            _step(model, opts[name], scalers[name], loss, clipper)
    assert all(s.get_scale() == 2.0**16 for s in scalers.values())  # no step overflowed
    out = {}
    for name, model in models.items():
        state = dp.full_state_dict(model) if name != "torch-ddp" else model.module.state_dict()
        out[name] = max(
            (state[key].float() - p.detach()).abs().max().item()
            for key, p in reference.named_parameters()
        )
    return out


def grid(world) -> dict:
    return {clip: recipe(world, clip) for clip in (None, "torch", "ours")}


def test_fp16_amp_recipe_within_pytorch_ddps_deviation_on_every_strategy():
    results = run_world(2, grid)
    assert results[0] == results[1]  # every rank holds the same model
    assert list(results[0]) == [None, "torch", "ours"], results[0]  # without, and two clips
    for clip, diffs in results[0].items():
        bound = SLACK * diffs["torch-ddp"]
        assert 0 < diffs["torch-ddp"] < 1e-3, (clip, diffs)
        for name in ("ddp", "zero1", "zero2", "zero3"):
            assert diffs[name] <= bound, (clip, name, diffs)

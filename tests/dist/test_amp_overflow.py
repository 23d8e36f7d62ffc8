"""PyTorch's AMP recipe with natural overflows at GradScaler's default scale, on every strategy.

An unmodified `torch.amp.GradScaler` starts at 65536. Here that scale overflows fp16 at the
first two steps, in one process and in PyTorch's DDP alike (the last layer's weight gradient,
a sum over the samples: the same size per rank as on the global batch, so one process and every
rank of a world overflow at the same steps); both skip them, halve the scale twice and then
train. Every strategy must do the same: skip exactly those steps, leave the model untouched by
them, then train as one process does. ZeRO-1 used to find every later step non-finite too (the
skipped step's poison stayed in its buckets' padding, which every later reduction summed), so
the scale kept halving and the model never trained again: 2.1e-2 from one process where
PyTorch's DDP is 2.9e-3 on the issue's GPT. Bound: within 1.5 times PyTorch's DDP's own
deviation from one process (fp16 rounds the chunked forward differently).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dataparallel as dp

from .harness import run_world

STEPS, PER_RANK, SEED = 10, 16, 7
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CLIP = 100.0  # far above the true norm: the recipe's clip, not a change
SMALL = {"bucket_mb": 0.0005, "first_bucket_mb": 0.0002}  # a few buckets, most of them padded
SLACK = 1.5
# The scale after each step, in one process: 65536 and 32768 overflow, 16384 trains.
SCALES = [32768.0] + [16384.0] * (STEPS - 1)


def build() -> nn.Module:
    """Odd widths, so that the buckets and units carry padding."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(7, 31), nn.LayerNorm(31), nn.GELU(), nn.Linear(31, 5, bias=False)
    )


def batch(step: int, size: int):
    """Inputs around 1 and targets around 3: the last layer's weight gradient sums same-sign
    terms, so at scale 65536 it overflows fp16 whatever the split of the batch."""
    g = torch.Generator().manual_seed(1000 + step)
    return 1 + 0.1 * torch.randn(size, 7, generator=g), torch.randn(size, 5, generator=g) + 3


def _step(model, opt, scaler, loss, clip) -> None:
    scaler.scale(loss.float()).backward()
    if clip is not None:
        scaler.unscale_(opt)
        clip(model, CLIP)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _ours_clip(model, max_norm):
    dp.clip_grad_norm_(model, max_norm)


def _torch_clip(model, max_norm):
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _state(name, model) -> dict[str, torch.Tensor]:
    if name == "torch-ddp":
        return {k: v.clone() for k, v in model.module.state_dict().items()}
    return {k: v.clone() for k, v in dp.full_state_dict(model).items()}


def recipe(world, clip: bool) -> dict:
    """Per strategy: max |theirs - one process| after STEPS steps, the scale history, whether
    the skipped steps left the model untouched and how far the later steps moved it."""
    n, rank = world.world_size, world.rank
    reference = build()
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    policies = {
        "ddp": dp.DDP(**SMALL),
        "zero1": dp.ZeRO1(**SMALL),
        "zero1-all_reduce": dp.ZeRO1(**SMALL, grad_reduce="all_reduce"),
        "zero1-overlap": dp.ZeRO1(**SMALL, overlap_param_gather=True),
        "zero2": dp.ZeRO2(**SMALL),
        "zero3": dp.ZeRO3(),
    }
    models, opts = {}, {}
    for name, policy in policies.items():
        models[name] = dp.parallelize(build(), policy)
        opts[name] = dp.build_optimizer(models[name], torch.optim.AdamW, **ADAMW)
    models["torch-ddp"] = DistributedDataParallel(build())
    opts["torch-ddp"] = torch.optim.AdamW(models["torch-ddp"].parameters(), **ADAMW)
    clips = {name: (_torch_clip if name == "torch-ddp" else _ours_clip) for name in models}
    scalers = {name: torch.amp.GradScaler("cpu") for name in ["one", *models]}
    scales = {name: [] for name in scalers}
    start = {name: _state(name, m) for name, m in models.items()}
    after_skips = {}
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * n)
        with torch.autocast("cpu", dtype=torch.float16):
            chunks = zip(x.chunk(n), y.chunk(n), strict=True)
            loss = torch.stack([F.mse_loss(reference(cx), cy) for cx, cy in chunks]).mean()
        _step(reference, ref_opt, scalers["one"], loss, _torch_clip if clip else None)
        scales["one"].append(scalers["one"].get_scale())
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        for name, model in models.items():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(mine[0]), mine[1])
            _step(model, opts[name], scalers[name], loss, clips[name] if clip else None)
            scales[name].append(scalers[name].get_scale())
            if step == 1:
                after_skips[name] = _state(name, model)
    out = {"one": {"scales": scales["one"]}}
    for name, model in models.items():
        final = _state(name, model)
        out[name] = {
            "diff": max(
                (final[key].float() - p.detach()).abs().max().item()
                for key, p in reference.named_parameters()
            ),
            "scales": scales[name],
            "skips_untouched": all(
                torch.equal(start[name][k], v) for k, v in after_skips[name].items()
            ),
            "moved": max((final[k] - v).abs().max().item() for k, v in after_skips[name].items()),
        }
    return out


def grid(world) -> dict:
    return {clip: recipe(world, clip) for clip in (False, True)}


def test_fp16_natural_overflows_skipped_then_trained_on_every_strategy():
    results = run_world(2, grid)
    assert results[0] == results[1]  # every rank holds the same model and scales
    cases = 0
    for clip, by_name in results[0].items():
        assert by_name["one"]["scales"] == SCALES, (clip, by_name["one"])  # the premise
        torch_ddp = by_name["torch-ddp"]["diff"]
        assert 0 < torch_ddp < 1e-3, (clip, by_name["torch-ddp"])
        for name, got in by_name.items():
            if name == "one":
                continue
            assert got["scales"] == SCALES, (clip, name, got)  # skipped the two, no more
            assert got["skips_untouched"], (clip, name)
            assert got["moved"] > 5e-2, (clip, name, got)  # the later steps trained
            assert got["diff"] <= SLACK * torch_ddp, (clip, name, got["diff"], torch_ddp)
            cases += 1
    assert cases == 2 * 7

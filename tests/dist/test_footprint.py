"""The policies' footprints ([Note: footprint] in strategies/parts/footprint.py), which the
planner reports, against what the strategies hold after a step (`dp.memory_report`).

Every strategy x {fp32, bf16 parameters with fp32 masters} x {1-D over 2 ranks, 1-D over 4,
2 x 2 mesh} on a GPT and on a model whose sizes divide by nothing (so every bucket and unit is
padded and the ranks' pieces differ), small buckets (several per model) and the defaults:
one AdamW step, then parameters, gradients, optimizer state and masters, on every rank, to
the byte, and ZeRO-3's largest gathered unit. The one difference allowed is Adam's `step`, a 4-byte tensor per parameter piece (one per
run of pieces stepped flat, [Note: flat step]) the footprint does not count (it is not per
element); the test reads it from the optimizer.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dataparallel as dp
from dataparallel.strategies.base import tensor_bytes
from dataparallel.strategies.zero3.plan import param_shapes

from .harness import run_world
from .models import batch, build, loss_fn

SMALL = {"bucket_mb": 0.01, "first_bucket_mb": 0.002}
PRECISIONS = {"fp32": None, "bf16-params": dp.MixedPrecision(param_dtype=torch.bfloat16)}


def policies(precision) -> dict:
    return {
        "ddp": dp.DDP(precision=precision, **SMALL),
        "ddp-default": dp.DDP(precision=precision),
        "zero1": dp.ZeRO1(precision=precision, **SMALL),
        "zero2": dp.ZeRO2(precision=precision, **SMALL),
        "zero2-default": dp.ZeRO2(precision=precision),
        "zero3": dp.ZeRO3(precision=precision),
    }


def measure(model_name: str, policy, mesh) -> tuple[dict, dict]:
    """(footprint, memory_report) of this rank after one AdamW step."""
    model = build(model_name, 0)
    shapes = param_shapes(model)
    group = mesh.shard_group if mesh is not None else None
    model = dp.parallelize(model, policy, mesh=mesh)
    opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = batch(model_name, 0, 2)
    loss_fn(model_name, model, x, y, 0, 0).backward()
    opt.step()
    report = dp.memory_report(model, opt)
    steps = tensor_bytes(s["step"] for s in opt.state.values() if "step" in s)  # shared in a run
    if isinstance(policy, dp.DDP):
        f = policy.footprint(shapes, optimizer_bytes=8)  # ZeRO-1 on S = 1 under bf16
        shard_rank = 0
    else:
        size = mesh.shard_size if mesh is not None else torch.distributed.get_world_size()
        shard_rank = torch.distributed.get_rank(group)
        f = policy.footprint(shapes, shard_size=size, optimizer_bytes=8, rank=shard_rank)
    planned = {"params": f.params, "grads": f.grads, "optimizer_state": f.optimizer + f.masters,
               "master_params": f.masters}  # fmt: skip
    held = {"params": report["params"], "grads": report["grads"],
            "optimizer_state": report["optimizer_state"] - steps,
            "master_params": report.get("master_params", 0)}  # fmt: skip
    if "largest_gathered_unit" in report:  # ZeRO-3: the largest unit gathered, in p
        planned["largest_gathered_unit"] = max(f.gathers)
        held["largest_gathered_unit"] = report["largest_gathered_unit"]
    return planned, held


def grid(world) -> dict:
    n = world.world_size
    meshes = {f"1-D x{n}": None}
    if n == 4:
        meshes["2x2"] = dp.init_mesh(2)
    out = {}
    for layout, mesh in meshes.items():
        for precision_name, precision in PRECISIONS.items():
            for name, policy in policies(precision).items():
                if name.startswith("ddp") and mesh is not None:
                    continue  # DDP takes no mesh
                for model_name in ("transformer", "odd"):
                    key = (name, precision_name, layout, model_name)
                    out[key] = measure(model_name, policy, mesh)
    return out


@functools.cache
def results() -> dict:
    """key -> [(planned, held) per rank], from a world of 2 and a world of 4."""
    out: dict = {}
    for n in (2, 4):
        for rank_results in run_world(n, grid, timeout=600):
            for key, value in rank_results.items():
                out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_footprint_is_what_the_strategy_holds_on_every_rank(strategy):
    cases = {k: v for k, v in results().items() if k[0].split("-")[0] == strategy}
    assert len(cases) == {"ddp": 16, "zero1": 12, "zero2": 24, "zero3": 12}[strategy]
    for key, ranks in cases.items():
        for rank, (planned, held) in enumerate(ranks):
            assert planned == held, (key, rank)

"""PyTorch's own gradient utilities on `model.parameters()` under every strategy.

DDP keeps the reduced gradient in the model's `.grad`, so `torch.nn.utils.clip_grad_norm_` and
`clip_grad_value_` give the one-process result there. Under ZeRO-1/2/3 the reduced gradient is
a run of flat shards; the model's `.grad` refuse every use with one line naming the call and the
way that works ([Note: sharded gradients]): PyTorch's clips, a logged `p.grad.norm()`, the
`if p.grad is not None: total += p.grad.norm()` loop (which used to sum zero). What works is
exact: `dp.clip_grad_norm_` and `dp.clip_grad_value_` with bounds that bite at every step, and
`dp.grad_norms`, within 1e-5 of one process (momentum SGD, 5 steps, 2 ranks), and on a 2 x 2
mesh (4 ranks, with `dp.EMA`).
"""

from __future__ import annotations

import torch

import dataparallel as dp

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss

STEPS, PER_RANK, MODEL, SEED = 5, 4, "transformer", 11
SGD = {"lr": 0.05, "momentum": 0.9}
MAX_NORM, MAX_VALUE = 0.05, 2e-3  # both below what every step's gradient reaches: they bite
SMALL = {"bucket_mb": 0.02, "first_bucket_mb": 0.002}
TOL = 1e-5
POLICIES = {
    "ddp": lambda: dp.DDP(**SMALL),
    "zero1": lambda: dp.ZeRO1(**SMALL),
    "zero2": lambda: dp.ZeRO2(**SMALL),
    "zero3": lambda: dp.ZeRO3(),
}


def _torch_norm(model):
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))


def _torch_value(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    biting = max(g.abs().max().item() for g in grads) > MAX_VALUE
    torch.nn.utils.clip_grad_value_(model.parameters(), MAX_VALUE)
    return biting


def _logged_norms(model) -> float:
    """A user's logging loop over the model's gradients."""
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            total += p.grad.norm().item() ** 2
    return total**0.5


USES = {
    "torch.nn.utils.clip_grad_norm_": _torch_norm,
    "torch.nn.utils.clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(
        m.parameters(), MAX_VALUE
    ),
    ".grad.norm": _logged_norms,
}


def _refusals(model) -> dict[str, str]:
    """Each of PyTorch's uses after backward: the error's text, or 'worked'."""
    out = {}
    for name, use in USES.items():
        try:
            use(model)
            out[name] = "worked"
        except RuntimeError as error:
            out[name] = str(error)
    return out


def run(world, clip: str) -> dict:
    """One process and every strategy for STEPS steps with `clip` ("norm" or "value"): PyTorch's
    clip in one process, ours (dp.clip_*; under DDP PyTorch's too); diffs, norms, refusals."""
    n, rank = world.world_size, world.rank
    reference = build(MODEL, SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), **SGD)
    models = {
        name: dp.parallelize(build(MODEL, SEED), policy()) for name, policy in POLICIES.items()
    }
    models["ddp-torch-clip"] = dp.parallelize(build(MODEL, SEED), dp.DDP(**SMALL))
    opts = {name: dp.build_optimizer(m, torch.optim.SGD, **SGD) for name, m in models.items()}
    out = {name: {"norms": [], "grad_norms": None} for name in models}
    ref_norms, ref_grad_norms, bites = [], None, []
    for step in range(STEPS):
        x, y = batch(MODEL, step, PER_RANK * n)
        reference_loss(MODEL, reference, x, y, step, n).backward()
        if step == 0:
            ref_grad_norms = {k: p.grad.norm() for k, p in reference.named_parameters()}
        if clip == "norm":
            ref_norms.append(_torch_norm(reference))
        else:
            bites.append(_torch_value(reference))
        ref_opt.step()
        ref_opt.zero_grad()
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        for name, model in models.items():
            loss_fn(MODEL, model, *mine, step, rank).backward()
            if step == 0:
                out[name]["grad_norms"] = dp.grad_norms(model)
                if name.startswith("zero"):
                    out[name]["refusals"] = _refusals(model)
            if name == "ddp-torch-clip":
                norm = _torch_norm(model) if clip == "norm" else _torch_value(model)
            elif clip == "norm":
                norm = float(dp.clip_grad_norm_(model, MAX_NORM))
            else:
                norm = dp.clip_grad_value_(model, MAX_VALUE)
            out[name]["norms"].append(norm)
            opts[name].step()
            opts[name].zero_grad()
            model.zero_grad()  # clears the model's .grad, whatever they are
    reference_state = reference.state_dict()
    for name, model in models.items():
        state = dp.full_state_dict(model)
        got = out[name]
        got["diff"] = max((state[k] - v).abs().max().item() for k, v in reference_state.items())
        got["grad_norms"] = max(
            abs(got["grad_norms"][k].item() - v.item()) / v.item()
            for k, v in ref_grad_norms.items()
        )
        if clip == "norm":
            got["norms"] = max(abs(a - b) / b for a, b in zip(got["norms"], ref_norms))
    out["ref_norms"], out["bites"] = ref_norms, bites
    return out


def grid(world) -> dict:
    return {clip: run(world, clip) for clip in ("norm", "value")}


def test_torch_clip_exact_under_ddp_refused_in_one_line_under_zero_ours_exact_everywhere():
    results = run_world(2, grid)
    cases = 0
    for clip, out in results[0].items():
        if clip == "norm":
            assert min(out["ref_norms"]) > MAX_NORM, out["ref_norms"]  # it bites every step
        else:
            assert all(out["bites"]), out["bites"]
        for name in [*POLICIES, "ddp-torch-clip"]:
            got = out[name]
            assert got["diff"] < TOL, (clip, name, got)
            assert got["grad_norms"] < TOL, (clip, name, got)
            if clip == "norm":
                assert got["norms"] < TOL, (clip, name, got)
            if name.startswith("zero"):
                for call, message in got["refusals"].items():
                    assert message.startswith(call) and "\n" not in message, (name, message)
                    assert f"under {name}" in message, message
                    assert "dataparallel.clip_grad_norm_(model, max_norm)" in message, message
            cases += 1
    assert cases == 2 * 5


def mesh_grid(world) -> dict:
    """ZeRO-1/2/3 on a 2 x 2 mesh (shards of 2, 2 replicas): dp.grad_norms, dp.clip_grad_value_
    and dp.EMA against one process (the replicas hold the same shards: counted once)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    n, rank = world.world_size, world.rank
    reference = build(MODEL, SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), **SGD)
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    mesh = dp.init_mesh(2)
    sharded = ("zero1", "zero2", "zero3")
    models = {name: dp.parallelize(build(MODEL, SEED), name, mesh=mesh) for name in sharded}
    opts = {name: dp.build_optimizer(m, torch.optim.SGD, **SGD) for name, m in models.items()}
    emas = {name: dp.EMA(m, 0.9) for name, m in models.items()}
    out = {name: {} for name in models}
    for step in range(3):
        x, y = batch(MODEL, step, PER_RANK * n)
        reference_loss(MODEL, reference, x, y, step, n).backward()
        if step == 0:
            ref_norms = {k: p.grad.norm().item() for k, p in reference.named_parameters()}
        torch.nn.utils.clip_grad_value_(reference.parameters(), MAX_VALUE)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_ema.update_parameters(reference)
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        for name, model in models.items():
            loss_fn(MODEL, model, *mine, step, rank).backward()
            if step == 0:
                norms = dp.grad_norms(model)
                out[name]["grad_norms"] = max(
                    abs(norms[k].item() - v) / v for k, v in ref_norms.items()
                )
                out[name]["refusal"] = _refusals(model)["torch.nn.utils.clip_grad_norm_"]
            dp.clip_grad_value_(model, MAX_VALUE)
            opts[name].step()
            opts[name].zero_grad()
            emas[name].update()
    weights, average = reference.state_dict(), ref_ema.module.state_dict()
    for name, model in models.items():
        state, ema = dp.full_state_dict(model), emas[name].full_state_dict()
        out[name]["diff"] = max((state[k] - v).abs().max().item() for k, v in weights.items())
        out[name]["ema"] = max((ema[k] - v).abs().max().item() for k, v in average.items())
    return out


def test_on_a_2x2_mesh_ours_exact_and_torch_clip_refused():
    out = run_world(4, mesh_grid)[0]
    assert sorted(out) == ["zero1", "zero2", "zero3"]
    for name, got in out.items():
        assert max(got["grad_norms"], got["diff"], got["ema"]) < TOL, (name, got)
        assert got["refusal"].startswith("torch.nn.utils.clip_grad_norm_ read"), got

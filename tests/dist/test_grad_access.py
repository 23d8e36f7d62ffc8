"""PyTorch's own gradient utilities on `model.parameters()` under every strategy.

DDP keeps the reduced gradient in the model's `.grad`. Under ZeRO-1/2/3 the reduced gradient is
a run of flat shards (or an owner's whole tensor), and the model's `.grad` read it where it
lives ([Note: sharded gradients]): `torch.nn.utils.clip_grad_norm_` and `clip_grad_value_` with
bounds that bite at every step, a logging loop of `p.grad.norm()` (and `.abs().max()`,
`.mean()`, `.pow(2).sum()`, `torch.isfinite(...).all()`), `model.zero_grad()` in place of the
optimizer's, all give the one-process result on every strategy (momentum SGD, 5 steps, 2
ranks), and on a 2 x 2 mesh (4 ranks, with `dp.EMA`); `dp.clip_grad_norm_`,
`dp.clip_grad_value_` and `dp.grad_norms` too. An element of `p.grad` read on one rank is
refused in one line under ZeRO (it is not there).
"""

from __future__ import annotations

from functools import cache

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


def _logged(model) -> dict[str, float]:
    """What a logging loop reads of each gradient (a collective under ZeRO: every rank runs it)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        out[name + " norm"] = g.norm().item()
        out[name + " absmax"] = g.abs().max().item()
        out[name + " mean"] = g.mean().item()
        out[name + " squares"] = g.pow(2).sum().item()
        out[name + " std"] = g.std().item()
        out[name + " finite"] = float(torch.isfinite(g).all().item())
    out["foreach"] = sum(
        t.item() for t in torch._foreach_norm([p.grad for p in model.parameters()])
    )
    return out


def _element(model) -> str:
    """One element of a gradient, read on this rank: exact under DDP, refused under ZeRO."""
    try:
        return f"{float(next(model.parameters()).grad.reshape(-1)[0]):.6g}"
    except RuntimeError as error:
        return str(error)


def run(world, clip: str) -> dict:
    """One process and every strategy for STEPS steps with `clip` ("norm" or "value"):
    PyTorch's clip on `model.parameters()` everywhere (and ours beside it); diffs, norms, what a
    logging loop reads, and `model.zero_grad()` as the only reset."""
    n, rank = world.world_size, world.rank
    reference = build(MODEL, SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), **SGD)
    models = {
        name: dp.parallelize(build(MODEL, SEED), policy()) for name, policy in POLICIES.items()
    }
    models.update(
        {f"{name}-ours": dp.parallelize(build(MODEL, SEED), POLICIES[name]()) for name in POLICIES}
    )
    opts = {name: dp.build_optimizer(m, torch.optim.SGD, **SGD) for name, m in models.items()}
    out = {name: {"norms": [], "grad_norms": None} for name in models}
    ref_norms, ref_logged, bites = [], None, []
    for step in range(STEPS):
        x, y = batch(MODEL, step, PER_RANK * n)
        reference_loss(MODEL, reference, x, y, step, n).backward()
        if step == 0:
            ref_logged = _logged(reference)
            ref_element = _element(reference)
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
                out[name]["logged"] = _logged(model)
                out[name]["element"] = _element(model)
            if name.endswith("-ours"):
                norm = (
                    float(dp.clip_grad_norm_(model, MAX_NORM))
                    if clip == "norm"
                    else dp.clip_grad_value_(model, MAX_VALUE)
                )
            else:
                norm = _torch_norm(model) if clip == "norm" else _torch_value(model)
            out[name]["norms"].append(norm)
            opts[name].step()
            if name.endswith("-ours"):
                opts[name].zero_grad()
            else:
                model.zero_grad()  # the Hugging Face Trainer's reset: the model's, not the optimizer's
    reference_state = reference.state_dict()
    ref_grad_norms = {
        k.removesuffix(" norm"): v for k, v in ref_logged.items() if k.endswith(" norm")
    }
    for name, model in models.items():
        state = dp.full_state_dict(model)
        got = out[name]
        got["diff"] = max((state[k] - v).abs().max().item() for k, v in reference_state.items())
        got["grad_norms"] = max(
            abs(got["grad_norms"][k].item() - v) / v for k, v in ref_grad_norms.items()
        )
        got["logged"] = max(
            abs(got["logged"][k] - v) / max(abs(v), 1e-3) for k, v in ref_logged.items()
        )
        got["logged_count"] = len(ref_logged)
        if clip == "norm":
            got["norms"] = max(abs(a - b) / b for a, b in zip(got["norms"], ref_norms, strict=True))
    out["ref_norms"], out["bites"] = ref_norms, bites
    out["ref_element"] = ref_element
    return out


def grid(world) -> dict:
    return {clip: run(world, clip) for clip in ("norm", "value")}


@cache
def results() -> list[dict]:
    return run_world(2, grid)


def test_torch_clip_and_gradient_reads_exact_on_every_strategy():
    cases = 0
    for clip, out in results()[0].items():
        if clip == "norm":
            assert min(out["ref_norms"]) > MAX_NORM, out["ref_norms"]  # it bites every step
        else:
            assert all(out["bites"]), out["bites"]
        for name in [*POLICIES, *(f"{p}-ours" for p in POLICIES)]:
            got = out[name]
            assert got["diff"] < TOL, (clip, name, got)
            assert got["grad_norms"] < TOL, (clip, name, got)
            assert got["logged"] < TOL, (clip, name, got)
            assert got["logged_count"] == 6 * len(list(build(MODEL, SEED).parameters())) + 1
            if clip == "norm":
                assert got["norms"] < TOL, (clip, name, got)
            cases += 1
    assert cases == 2 * 8


def test_an_element_of_a_gradient_is_refused_in_one_line_under_zero():
    out = results()[0]["norm"]
    assert out["ddp"]["element"] == out["ref_element"] != ""
    for name in ("zero1", "zero2", "zero3"):
        message = out[name]["element"]
        assert message.startswith(".grad.reshape on a model parameter's .grad"), message
        assert f"cannot be exact under {name}" in message and "\n" not in message, message


def mesh_grid(world) -> dict:
    """ZeRO-1/2/3 on a 2 x 2 mesh (shards of 2, 2 replicas): dp.grad_norms, PyTorch's
    clip_grad_norm_ (its total norm) and clip_grad_value_, and dp.EMA against one process (the
    replicas hold the same shards: counted once)."""
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
            total = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
            ref_norms["total"] = float(total)
            ref_opt.zero_grad()  # step 0 on every side: a look at the gradients, no update
        else:
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
                    abs(norms[k].item() - v) / v for k, v in ref_norms.items() if k != "total"
                )
                out[name]["torch_norm"] = _torch_norm(model) / ref_norms["total"]
                opts[name].zero_grad()  # the clip above scaled the gradient: step without it
                continue
            torch.nn.utils.clip_grad_value_(model.parameters(), MAX_VALUE)
            opts[name].step()
            opts[name].zero_grad()
            emas[name].update()
    weights, average = reference.state_dict(), ref_ema.module.state_dict()
    for name, model in models.items():
        state, ema = dp.full_state_dict(model), emas[name].full_state_dict()
        out[name]["diff"] = max((state[k] - v).abs().max().item() for k, v in weights.items())
        out[name]["ema"] = max((ema[k] - v).abs().max().item() for k, v in average.items())
    return out


def test_on_a_2x2_mesh_torch_clip_and_ours_exact():
    out = run_world(4, mesh_grid)[0]
    assert sorted(out) == ["zero1", "zero2", "zero3"]
    for name, got in out.items():
        assert max(got["grad_norms"], got["diff"], got["ema"]) < TOL, (name, got)
        assert abs(got["torch_norm"] - 1) < TOL, (name, got)  # replicas counted once

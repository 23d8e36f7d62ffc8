"""Whole-parameter ownership ([Note: optimizer layout] in strategies/parts/optimizer_layout.py): optimizers
that are not elementwise, exact on every strategy against one process on the global batch.

Two spawned worlds run every case (start-up paid twice): 2 ranks (DDP, ZeRO-1/2/3; param
groups, no_sync accumulation, clipping, checkpoint resume across strategies) and 4 ranks (a
2-D mesh of shard groups of 2, and a 2-matrix model on 4 ranks, where two ranks own nothing).
Each grid asserts its number of cases, so none passes vacuously.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from functools import cache

import torch
from torch import nn

import dataparallel as dp
from dataparallel.checkpoint import load_state, save_chunks, state_chunks
from dataparallel.strategies.parts.torch_calls import is_carrier

from .harness import run_world
from .models import SMALL, batch, build, loss_fn, reference_loss, strategy

TOL = 1e-5
STEPS = 4
PER_RANK = 4


class Lamb(torch.optim.Optimizer):
    """A user's LAMB-style optimizer: momentum, then each parameter's step scaled by its trust
    ratio ||w|| / ||update||, a whole-tensor statistic. Declared reads="parameter" where it is
    built (DECLARED)."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                update = buf + group["weight_decay"] * p
                w, u = p.norm(), update.norm()
                ratio = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                p.sub_(group["lr"] * ratio * update)


OPTIMIZERS = {
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "lamb": (Lamb, {"lr": 0.05}),
}


# What each declares at build_optimizer: the LAMB-style class reads its own parameter only, so
# it keeps balanced owners (undeclared it gets one owner: tests/dist/test_user_lines.py).
DECLARED = {"adafactor": {}, "lamb": {"reads": "parameter"}}


class TwoMatrices(nn.Module):
    """Two weight matrices and nothing else: on 4 ranks two of them own nothing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def make(model_name: str, seed: int) -> nn.Module:
    if model_name == "two":
        torch.manual_seed(seed)
        return TwoMatrices()
    return build(model_name, seed)


def groups_of(model: nn.Module, grouped: bool):
    """None, or two groups with different hyper-parameters (matrices and the rest)."""
    if not grouped:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "lr": 2e-2},
        {"params": [p for p in params if p.dim() < 2], "lr": 5e-3},
    ]


def train(world, model, opt, model_name, start, stop, accum=1, clip=None, reference=False):
    """Steps [start, stop): the reference on the global batch (`reference`), or this rank's."""
    rank, n = world.rank, world.world_size
    norms = []
    for step in range(start, stop):
        x, y = batch("mlp" if model_name == "two" else model_name, step, PER_RANK * n * accum)
        name = "mlp" if model_name == "two" else model_name
        if reference:
            reference_loss(name, model, x, y, step, n).backward()
            if clip:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        else:
            xs, ys = x.chunk(n)[rank].chunk(accum), y.chunk(n)[rank].chunk(accum)
            for micro in range(accum):
                quiet = dp.no_sync(model) if micro < accum - 1 else contextlib.nullcontext()
                with quiet:
                    (loss_fn(name, model, xs[micro], ys[micro], step, rank) / accum).backward()
            if clip:
                norms.append(dp.clip_grad_norm_(model, clip).item())
        opt.step()
        opt.zero_grad()
    return norms


def case(world, model_name, opt_name, names, grouped=False, accum=1, clip=None) -> dict:
    """Per strategy: max |params - one process| after STEPS (and the clip norms' rel. diff)."""
    cls, kwargs = OPTIMIZERS[opt_name]
    reference = make(model_name, 100)
    ref_opt = cls(groups_of(reference, grouped) or reference.parameters(), **kwargs)
    ref_norms = train(world, reference, ref_opt, model_name, 0, STEPS, accum, clip, reference=True)
    out = {}
    for name in names:
        policy, options = strategy(name)
        model = dp.parallelize(make(model_name, 100 + world.rank), policy, **options)
        opt = dp.build_optimizer(
            model, cls, groups_of(model, grouped), **kwargs, **DECLARED[opt_name]
        )
        norms = train(world, model, opt, model_name, 0, STEPS, accum, clip)
        full = dp.full_state_dict(model)
        diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        out[name] = {"params": diff}
        if clip:
            out[name]["norm"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True))
            out[name]["bites"] = min(ref_norms) > clip
    return out


def resume(world, opt_name, root: str) -> dict:
    """Train 2 steps on one strategy, save, resume 2 more on another, through the plain state
    dicts and through a sharded checkpoint; the saved optimizer state against the reference's,
    the end against 4 reference steps."""
    cls, kwargs = OPTIMIZERS[opt_name]
    reference = make("transformer", 100)
    ref_opt = cls(reference.parameters(), **kwargs)
    train(world, reference, ref_opt, "transformer", 0, 2, reference=True)
    ref_state = copy.deepcopy(ref_opt.state_dict()["state"])  # before it steps on
    train(world, reference, ref_opt, "transformer", 2, 4, reference=True)
    out = {}
    for first, second in (("zero1", "zero3"), ("zero2", "zero1"), ("zero3", "zero2")):
        model = dp.parallelize(make("transformer", 100), strategy(first)[0])
        opt = dp.build_optimizer(model, cls, **kwargs, **DECLARED[opt_name])
        train(world, model, opt, "transformer", 0, 2)
        weights, state = dp.full_state_dict(model), dp.optimizer_state_dict(model, opt)
        saved = max(
            (state["state"][i][k] - v).abs().max().item()
            for i, entry in ref_state.items()
            for k, v in entry.items()
            if torch.is_tensor(v)
        )
        folder = f"{root}/{opt_name}-{first}"
        save_chunks(state_chunks(model, opt, rank=world.rank), folder, world.group)
        for way in ("plain", "dcp"):
            again = dp.parallelize(make("transformer", 7), strategy(second)[0])
            opt = dp.build_optimizer(again, cls, **kwargs, **DECLARED[opt_name])
            if way == "plain":
                dp.load_full_state_dict(again, weights)
                dp.load_optimizer_state_dict(again, opt, state)
            else:
                load_state(folder, again, opt, rank=world.rank, group=world.group)
            train(world, again, opt, "transformer", 2, 4)
            end = dp.full_state_dict(again)
            diff = max((end[k] - v).abs().max().item() for k, v in reference.state_dict().items())
            out[f"{first}->{second} {way}"] = {"state": saved, "params": diff}
    return out


def scaled(world, opt_name, names) -> dict:
    """An unmodified `torch.amp.GradScaler`, and an inf in rank 1's loss at step 1: every rank
    skips that step together (the owners see the poisoned gradient), as one process skips it."""
    cls, kwargs = OPTIMIZERS[opt_name]
    reference = make("transformer", 100)
    ref_opt = cls(reference.parameters(), **kwargs)
    for step in range(STEPS):
        if step != 1:
            train(world, reference, ref_opt, "transformer", step, step + 1, reference=True)
    out = {}
    for name in names:
        policy, options = strategy(name)
        model = dp.parallelize(make("transformer", 100), policy, **options)
        opt = dp.build_optimizer(model, cls, **kwargs, **DECLARED[opt_name])
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        n, rank = world.world_size, world.rank
        for step in range(STEPS):
            x, y = batch("transformer", step, PER_RANK * n)
            loss = loss_fn("transformer", model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank)
            if step == 1 and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        full = dp.full_state_dict(model)
        diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        out[name] = {"params": diff, "scale": scaler.get_scale()}
    return out


def diloco(world, opt_name, mesh) -> dict:
    """DiLoCo over the replicas of a 2 x 2 mesh with an owned inner optimizer: ZeRO-1/3 in each
    replica against DDP in each replica (DiLoCo reads and writes the owners' masters)."""
    cls, kwargs = OPTIMIZERS[opt_name]
    rank, n = world.rank, world.world_size
    out = {}
    for name in ("ddp", "zero1", "zero3"):
        policy = strategy(name)[0]
        model = dp.parallelize(make("transformer", 100), policy, group=mesh.shard_group)
        opt = dp.build_optimizer(model, cls, **kwargs, **DECLARED[opt_name])
        averager = dp.DiLoCo(model, opt, every=2, group=mesh.replicate_group)
        for step in range(STEPS):
            x, y = batch("transformer", step, PER_RANK * n)
            loss_fn("transformer", model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank).backward()
            opt.step()
            opt.zero_grad()
            averager.step()
        out[name] = dp.full_state_dict(model)
    return {
        name: {"params": max((out[name][k] - v).abs().max().item() for k, v in out["ddp"].items())}
        for name in ("zero1", "zero3")
    }


def world2(world, root: str) -> dict:
    names = ("ddp", "zero1", "zero2", "zero3")
    out = {}
    for opt_name in OPTIMIZERS:
        out[opt_name, "plain"] = case(world, "transformer", opt_name, names)
        out[opt_name, "tied"] = case(world, "tied", opt_name, names)
        out[opt_name, "groups"] = case(world, "transformer", opt_name, names, grouped=True)
        out[opt_name, "no_sync"] = case(world, "transformer", opt_name, names, accum=2)
        out[opt_name, "clip"] = case(world, "transformer", opt_name, names, clip=0.05)
        out[opt_name, "resume"] = resume(world, opt_name, root)
        out[opt_name, "scaler"] = scaled(world, opt_name, names)
    return out


def world4(world, root: str) -> dict:
    out = {}
    mesh = ("zero1-2d", "zero2-2d", "zero3-2d")
    flat = ("zero1", "zero2", "zero3")
    grid = dp.init_mesh(2)
    for opt_name in OPTIMIZERS:
        out[opt_name, "diloco"] = diloco(world, opt_name, grid)
        out[opt_name, "2d"] = case(world, "transformer", opt_name, mesh)
        out[opt_name, "empty"] = case(world, "two", opt_name, flat)
        cls, kwargs = OPTIMIZERS[opt_name]
        model = dp.parallelize(make("two", 1), dp.ZeRO1(**SMALL))
        opt = dp.build_optimizer(model, cls, **kwargs, **DECLARED[opt_name])
        held = [p for g in opt.param_groups for p in g["params"] if not is_carrier(p)]
        out[opt_name, "owned"] = {"zero1": len(held)}
    return out


@cache
def results(n: int) -> list[dict]:
    """Every rank's results of the world of `n` ranks (the ranks' diffs are equal)."""
    root = tempfile.mkdtemp(prefix="owners-")  # the sharded checkpoints (every rank sees it)
    return run_world(n, world2 if n == 2 else world4, root, timeout=600)


def flatten(result: dict) -> dict:
    return {(*key, name): v for key, row in result.items() for name, v in row.items()}


def test_every_strategy_matches_one_process_for_adafactor_and_a_users_lamb():
    cases = {k: v for k, v in flatten(results(2)[0]).items() if k[1] not in ("resume", "scaler")}
    assert len(cases) == 2 * 5 * 4  # optimizers x (plain, tied, groups, no_sync, clip) x strategies
    worst = {k: v["params"] for k, v in cases.items() if v["params"] > TOL}
    assert not worst, worst


def test_clipping_counts_each_owned_gradient_once():
    cases = {k: v for k, v in flatten(results(2)[0]).items() if k[1] == "clip"}
    assert len(cases) == 2 * 4
    assert all(v["bites"] for v in cases.values())
    assert max(v["norm"] for v in cases.values()) < 1e-5, cases


def test_checkpoint_of_an_owned_layout_resumes_on_another_strategy():
    cases = {k: v for k, v in flatten(results(2)[0]).items() if k[1] == "resume"}
    assert len(cases) == 2 * 3 * 2  # optimizers x strategy pairs x (plain state, DCP)
    assert max(v["state"] for v in cases.values()) < TOL, cases
    assert max(v["params"] for v in cases.values()) < TOL, cases


def test_a_loss_scalers_skipped_step_is_skipped_by_every_rank():
    for rank in results(2):
        cases = {k: v for k, v in flatten(rank).items() if k[1] == "scaler"}
        assert len(cases) == 2 * 4
        assert {v["scale"] for v in cases.values()} == {8.0}  # 16, halved once
        assert max(v["params"] for v in cases.values()) < TOL, cases


def test_a_2d_mesh_and_ranks_that_own_nothing():
    cases = {k: v for k, v in flatten(results(4)[0]).items() if k[1] in ("2d", "empty")}
    assert len(cases) == 2 * 3 * 2  # optimizers x strategies x (2-D mesh, empty owners)
    worst = {k: v["params"] for k, v in cases.items() if v["params"] > TOL}
    assert not worst, worst


def test_diloco_averages_the_owners_masters():
    cases = {k: v for k, v in flatten(results(4)[0]).items() if k[1] == "diloco"}
    assert len(cases) == 2 * 2  # optimizers x (ZeRO-1, ZeRO-3 in each replica)
    assert max(v["params"] for v in cases.values()) < TOL, cases


def test_on_four_ranks_two_matrices_leave_two_ranks_owning_nothing():
    for opt_name in OPTIMIZERS:
        counts = [rank[opt_name, "owned"]["zero1"] for rank in results(4)]
        assert sorted(counts) == [0, 0, 1, 1]

"""Distributed Muon: `torch.optim.Muon` unmodified on whole matrices owned per shard group
([Note: optimizer layout] in strategies/parts/optimizer_layout.py), and Muon + AdamW through one
`dp.build_optimizer` call ([Note: grouped optimizer] in strategies/parts/grouped.py).

One spawned world of 2 ranks runs every case: the update bit for bit against torch's Muon given
the same gradient (ZeRO-1/2/3); Muon + AdamW with one LR scheduler against one process, within
max(3 x PyTorch DDP's own deviation, 1e-5) (DDP, ZeRO-1/2/3); a resume through the plain state.
"""

from __future__ import annotations

import copy
from functools import cache

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dataparallel as dp

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss
from .muon_recipe import ADAMW, MUON, POLICIES, is_hidden_matrix, recipe

STEPS = 4
PER_RANK = 4
def schedule(step: int) -> float:
    return 1.0 / (1 + step)


class Reference:
    """PyTorch's own: one Muon and one AdamW over a model (one process, or under torch's DDP),
    each with its scheduler."""

    def __init__(self, model: nn.Module):
        named = list(model.named_parameters())
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        rest = [p for n, p in named if not is_hidden_matrix(n, p)]
        self.opts = [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.opts]

    def step(self):
        for o in self.opts:
            o.step()
            o.zero_grad()
        for s in self.schedulers:
            s.step()


def diff(model_state: dict, reference: nn.Module) -> float:
    return max((model_state[k] - v).abs().max().item() for k, v in reference.state_dict().items())


class Probe(nn.Module):
    """Two matrices whose gradients are given: forward(ga, gb) = sum(a * ga) + sum(b * gb)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(24, 16))
        self.b = nn.Parameter(torch.randn(16, 24))

    def forward(self, ga, gb):
        return (self.a * ga).sum() + (self.b * gb).sum()


def same_gradient(world) -> dict:
    """Every rank computes the same gradient, so the reduced one equals it exactly; the owners'
    Muon update then equals torch's Muon on one process, bit for bit."""
    torch.manual_seed(0)
    grads = [torch.randn(24, 16), torch.randn(16, 24)]
    out = {}
    for name in ("zero1", "zero2", "zero3"):
        torch.manual_seed(1)
        plain = Probe()
        reference = copy.deepcopy(plain)
        ref_opt = torch.optim.Muon(reference.parameters(), **MUON)
        model = dp.parallelize(plain, POLICIES[name]())
        opt = dp.build_optimizer(model, torch.optim.Muon, **MUON)
        equal = []
        for _ in range(3):
            for p, g in zip(reference.parameters(), grads, strict=True):
                p.grad = g.clone()
            ref_opt.step()
            model(*grads).backward()
            opt.step()
            opt.zero_grad()
            full = dp.full_state_dict(model)
            equal.append(
                all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
            )
        out[name] = equal
    return out


def muon_adamw(world) -> dict:
    """Muon + AdamW, one call, one LambdaLR, against one process and torch's DDP."""
    rank, n = world.rank, world.world_size
    reference = build("transformer", 100)
    ref = Reference(reference)
    theirs = DistributedDataParallel(build("transformer", 100))
    their = Reference(theirs.module)
    ours = {}
    for name, policy in POLICIES.items():
        model = dp.parallelize(build("transformer", 100 + rank), policy())
        opt = dp.build_optimizer(model, torch.optim.Muon, recipe(model), **MUON)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        ours[name] = (model, opt, scheduler)
    for step in range(STEPS):
        x, y = batch("transformer", step, PER_RANK * n)
        reference_loss("transformer", reference, x, y, step, n).backward()
        ref.step()
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        loss_fn("transformer", theirs, *mine, step, rank).backward()
        their.step()
        for model, opt, scheduler in ours.values():
            loss_fn("transformer", model, *mine, step, rank).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
    out = {"torch_ddp": diff(theirs.module.state_dict(), reference)}
    for name, (model, opt, _) in ours.items():
        out[name] = diff(dp.full_state_dict(model), reference)
        kinds = {tuple(sorted({p.dim() for p in g["params"]})) for g in opt.param_groups}
        out[name + " lr"] = [g["lr"] for g in opt.param_groups]
        out[name + " dims"] = sorted(kinds)
    out["reference lr"] = [o.param_groups[0]["lr"] for o in ref.opts]
    return out


def resume(world) -> dict:
    """Two steps on ZeRO-1, the plain state into a fresh ZeRO-3, two more: as four steps."""
    rank, n = world.rank, world.world_size
    reference = build("transformer", 100)
    ref = Reference(reference)
    models = []
    for name in ("zero1", "zero3"):
        model = dp.parallelize(build("transformer", 100 + 7 * len(models)), POLICIES[name]())
        models.append((model, dp.build_optimizer(model, torch.optim.Muon, recipe(model), **MUON)))
    for step in range(STEPS):
        x, y = batch("transformer", step, PER_RANK * n)
        reference_loss("transformer", reference, x, y, step, n).backward()
        ref.step()
        if step == 2:  # ZeRO-1's state into ZeRO-3
            first, second = models
            dp.load_full_state_dict(second[0], dp.full_state_dict(first[0]))
            state = dp.optimizer_state_dict(first[0], first[1])
            dp.load_optimizer_state_dict(second[0], second[1], state)
        model, opt = models[0] if step < 2 else models[1]
        loss_fn("transformer", model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank).backward()
        for g in opt.param_groups:
            g["lr"] = g.setdefault("initial_lr", g["lr"]) * schedule(step)
        opt.step()
        opt.zero_grad()
    return {"zero1->zero3": diff(dp.full_state_dict(models[1][0]), reference)}


def world2(world) -> dict:
    return {"bits": same_gradient(world), "recipe": muon_adamw(world), "resume": resume(world)}


@cache
def results() -> dict:
    return run_world(2, world2, timeout=600)[0]


def test_the_owners_muon_update_is_torchs_bit_for_bit():
    bits = results()["bits"]
    assert len(bits) == 3 and all(len(steps) == 3 for steps in bits.values())
    assert all(all(steps) for steps in bits.values()), bits


def test_muon_and_adamw_in_one_call_match_one_process_as_torchs_ddp_does():
    got = results()["recipe"]
    bound = max(3 * got["torch_ddp"], 1e-5)
    cases = {name: got[name] for name in POLICIES}
    assert len(cases) == 4
    assert max(cases.values()) <= bound, (cases, got["torch_ddp"])
    for name in ("zero1", "zero2", "zero3"):  # Muon's group whole matrices, AdamW's flat pieces
        assert got[name + " dims"] == [(1,), (2,)], got[name + " dims"]
    for name in POLICIES:  # one scheduler drove both classes' groups
        assert got[name + " lr"] == got["reference lr"]


def test_a_muon_and_adamw_state_resumes_on_another_strategy():
    assert results()["resume"]["zero1->zero3"] < 1e-5

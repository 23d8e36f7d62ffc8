"""MuLoCo (DiLoCo with Muon inside, arXiv 2505.23725) on real ranks: 2 replicas of 2 ranks.

Inside each replica the strategy (DDP, ZeRO-1/2/3) runs Muon on whole matrices, each owned by
one rank of the replica ([Note: optimizer layout] in strategies/parts/optimizer_layout.py), and
AdamW on flat pieces; DiLoCo's anchors and outer momentum are kept beside exactly those tensors,
so a matrix's outer state lives on its owner alone, and the replicate groups pair the ranks that
own the same matrices. Against a reference written here: the two replicas trained in one
process by torch's own Muon and AdamW, and the outer step done by hand (the replicas' mean
movement, Nesterov SGD on the anchors), within max(3 x PyTorch DDP's own deviation, 1e-5).
"""

from __future__ import annotations

from functools import cache, partial

import torch

import dataparallel as dp
from dataparallel.averaging import held_tensors

from .harness import run_world
from .models import batch, build, loss_fn, reference_loss
from .muon_recipe import ADAMW, MUON, POLICIES, is_hidden_matrix, recipe

STEPS, EVERY, PER_RANK, SHARD = 6, 3, 2, 2
OUTER = {"lr": 0.7, "momentum": 0.6, "nesterov": True}  # MuLoCo's outer settings


def torch_optimizers(model) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    return [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)]


class TwoReplicas:
    """The reference: each replica a torch model on its two ranks' samples; every EVERY steps
    the anchors move by Nesterov SGD along the replicas' mean movement, and both restart there."""

    def __init__(self):
        self.models = [build("transformer", 100) for _ in range(2)]
        self.opts = [torch_optimizers(m) for m in self.models]
        self.anchors = [p.detach().clone().requires_grad_(True) for p in self.models[0].parameters()]
        self.outer = torch.optim.SGD(self.anchors, **OUTER)

    def step(self, step: int, x, y, n: int) -> None:
        xs, ys = x.chunk(n), y.chunk(n)
        for r, (model, opts) in enumerate(zip(self.models, self.opts, strict=True)):
            mine = slice(r * SHARD, (r + 1) * SHARD)  # shard groups: consecutive ranks
            rx, ry = torch.cat(xs[mine]), torch.cat(ys[mine])
            reference_loss("transformer", model, rx, ry, step, SHARD).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        if (step + 1) % EVERY == 0:
            with torch.no_grad():
                params = [list(m.parameters()) for m in self.models]
                for i, anchor in enumerate(self.anchors):
                    anchor.grad = anchor - (params[0][i] + params[1][i]) / 2
                self.outer.step()
                for replica in params:
                    for p, anchor in zip(replica, self.anchors, strict=True):
                        p.copy_(anchor)


def muloco(world) -> dict:
    rank, n = world.rank, world.world_size
    reference = TwoReplicas()
    theirs = torch.nn.parallel.DistributedDataParallel(build("transformer", 100))
    their = torch_optimizers(theirs.module)
    ours = {}
    for name, policy in POLICIES.items():
        mesh = dp.init_mesh(SHARD)
        model = dp.parallelize(build("transformer", 100 + rank), policy(), group=mesh.shard_group)
        opt = dp.build_optimizer(model, torch.optim.Muon, recipe(model), **MUON)
        outer = partial(torch.optim.SGD, **OUTER)
        averager = dp.DiLoCo(model, opt, EVERY, group=mesh.replicate_group, outer_optimizer=outer)
        ours[name] = (model, opt, averager)
    for step in range(STEPS):
        x, y = batch("transformer", step, PER_RANK * n)
        reference.step(step, x, y, n)
        mine = x.chunk(n)[rank], y.chunk(n)[rank]
        loss_fn("transformer", theirs, *mine, step, rank).backward()  # DDP's own deviation
        for opt in their:
            opt.step()
            opt.zero_grad()
        for model, opt, averager in ours.values():
            loss_fn("transformer", model, *mine, step, rank).backward()
            opt.step()
            opt.zero_grad()
            averager.step()
    ddp_reference = build("transformer", 100)
    ddp_opts = torch_optimizers(ddp_reference)
    for step in range(STEPS):  # torch's DDP against one process: the tolerance's measure
        x, y = batch("transformer", step, PER_RANK * n)
        reference_loss("transformer", ddp_reference, x, y, step, n).backward()
        for opt in ddp_opts:
            opt.step()
            opt.zero_grad()
    expected = reference.models[rank // SHARD].state_dict()
    out = {"torch_ddp": _diff(theirs.module.state_dict(), ddp_reference.state_dict())}
    for name, (model, opt, averager) in ours.items():
        out[name] = _diff(dp.full_state_dict(model), expected)
        held = held_tensors(opt)
        outer_state = averager.state_dict()["tensors"]
        out[name + " held"] = sorted(tuple(t.shape) for t in held if t.dim() == 2)
        out[name + " flat"] = sum(t.numel() for t in held if t.dim() == 1)
        out[name + " beside"] = [  # anchor and momentum beside each held tensor, its size
            sorted(v.numel() for v in entries.values()) == [t.numel()] * 2
            for t, entries in zip(held, outer_state, strict=True)
        ]
    out["hidden"] = sum(
        1 for n_, p in build("transformer", 100).named_parameters() if is_hidden_matrix(n_, p)
    )
    return out


def _diff(ours: dict, reference: dict) -> float:
    return max((ours[k] - v).abs().max().item() for k, v in reference.items())


@cache
def results() -> list[dict]:
    return run_world(4, muloco, timeout=600)


def test_muloco_on_every_inner_strategy_equals_the_replicas_by_hand():
    for got in results():
        bound = max(3 * got["torch_ddp"], 1e-5)
        cases = {name: got[name] for name in POLICIES}
        assert len(cases) == 4
        assert max(cases.values()) <= bound, (cases, got["torch_ddp"])
        # ZeRO inside the replicas moves the same numbers as DDP inside them
        assert max(abs(got[name] - got["ddp"]) for name in POLICIES) < 1e-6, cases


def test_muloco_keeps_the_outer_state_beside_the_owned_whole_matrices():
    ranks = results()
    hidden = ranks[0]["hidden"]
    assert hidden >= 4
    for name in ("zero1", "zero2", "zero3"):
        for got in ranks:  # every held tensor has its anchor and momentum beside it
            assert got[name + " beside"] and all(got[name + " beside"]), name
        for replica in (0, 1):  # the replica's two ranks own the hidden matrices between them
            first, second = ranks[replica * SHARD][name + " held"], ranks[replica * SHARD + 1][
                name + " held"
            ]
            assert len(first) + len(second) == hidden and first and second, (name, first, second)
        for position in range(SHARD):  # the replicate group pairs owners of the same matrices
            assert ranks[position][name + " held"] == ranks[SHARD + position][name + " held"]
            assert ranks[position][name + " flat"] == ranks[SHARD + position][name + " flat"]
    for got in ranks:  # DDP inside: every matrix whole on every rank
        assert len(got["ddp held"]) >= hidden

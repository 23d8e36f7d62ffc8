"""`dp.handle_of`: the narrow handle features hold ([Note: the handle] in strategies/handle.py),
and DDP with fp32 masters as a layout: ZeRO-1 on shard groups of one rank, named "ddp" by it.

On 2 ranks, each case trains 3 steps of AdamW on its rank's half of a fixed batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import dataparallel as dp

from .harness import run_world

BF16 = dp.MixedPrecision(param_dtype=torch.bfloat16)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _case(name: str) -> nn.Module:
    if name == "ddp":
        return dp.parallelize(_net(), "ddp")
    if name == "ddp-masters":  # DDP with a low param_dtype: fp32 masters beside bf16 params
        return dp.parallelize(_net(), dp.DDP(precision=BF16))
    if name == "zero1-one-rank-shards":  # the same layout asked for by hand
        return dp.parallelize(_net(), dp.ZeRO1(precision=BF16, grad_reduce="all_reduce"),
                              mesh=dp.init_mesh(1))  # fmt: skip
    return dp.parallelize(_net(), name)


def _train(model: nn.Module, optimizer, rank: int) -> dict[str, list]:
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(3):
        mine = slice(4 * rank, 4 * rank + 4)
        loss = nn.functional.mse_loss(model(x[mine]).float(), y[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.float().tolist() for k, v in dp.full_state_dict(model).items()}


def _world(world):
    rank = world.rank
    out = {}
    for name in ("ddp", "ddp-masters", "zero1-one-rank-shards", "zero2", "zero3"):
        model = _case(name)
        handle = dp.handle_of(model)
        group = handle.replica_group
        pieces = handle.geometry().pieces
        held = sum(p.value.numel() for p in pieces)
        with handle.no_sync():  # accumulates locally: the gradient is this rank's own
            model(torch.full((1, 8), float(rank))).float().sum().backward()
        first = model[0].weight.grad
        local = None if first is None else first.abs().sum().item()
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
        optimizer.zero_grad()
        out[name] = {
            "name": handle.name,
            "replicas": None if group is None else dist.get_world_size(group),
            "held": held,
            "comms": len(handle.comms()),
            "local": local,
            "state": _train(model, optimizer, rank),
        }
    return out


def test_the_handle_answers_what_features_need_on_every_strategy():
    results = run_world(2, _world)
    assert len(results) == 2
    for rank, result in enumerate(results):
        assert len(result) == 5
        print(rank, {c: r["local"] for c, r in result.items()})
        names = {case: r["name"] for case, r in result.items()}
        assert names == {
            "ddp": "ddp",
            "ddp-masters": "ddp",  # a layout, named by it
            "zero1-one-rank-shards": "ddp",
            "zero2": "zero2",
            "zero3": "zero3",
        }
        # DDP with masters replicates across 2 one-rank shard groups; the 1-D ones have none
        assert result["ddp-masters"]["replicas"] == 2
        assert result["zero1-one-rank-shards"]["replicas"] == 2
        assert result["zero2"]["replicas"] is None
        # what a rank holds: every element under a one-rank shard group, half under ZeRO
        whole = sum(p.numel() for p in _net().parameters())
        assert result["ddp"]["held"] == whole
        assert result["ddp-masters"]["held"] == whole
        assert result["zero2"]["held"] == whole // 2
        assert result["zero3"]["held"] == whole // 2
        assert all(r["comms"] >= 1 for r in result.values())
        # under no_sync the first layer's gradient is this rank's own: rank 0 fed zeros
        locals_ = [r["local"] for r in result.values()]
        assert locals_ == [0.0] * 5 if rank == 0 else min(locals_) > 1.0, locals_
    # DDP with masters and ZeRO-1 on one-rank shard groups are the same strategy, bit for bit
    for result in results:
        a, b = result["ddp-masters"]["state"], result["zero1-one-rank-shards"]["state"]
        assert sorted(a) == sorted(b) and len(a) == 4
        assert all(a[k] == b[k] for k in a)
        moved = (torch.tensor(a["0.weight"]) - _net().state_dict()["0.weight"]).abs().max().item()
        assert moved > 1e-3  # it trained
    # every rank ends on the same model
    for name in results[0]:
        a, b = results[0][name]["state"], results[1][name]["state"]
        assert all(a[k] == b[k] for k in a), name

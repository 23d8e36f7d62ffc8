"""`dp.compose`: a script gets what `dataparallel train` gets ([Note: composition]).

The trainer builds its model, optimizer and averager with `dp.compose` alone; here each recipe
trains 4 steps on 4 ranks beside the same pieces assembled by hand (mesh, policy with its precision and
hook, optimizer, averager), and both end bit-identical.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.averaging import choose_outer
from dataparallel.models import GPT, GPTConfig

from .harness import run_world

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def _by_hand(name: str, model):
    """The pieces a recipe names, assembled without compose."""
    if name == "zero2-hsdp-int8":
        mesh = dp.init_mesh(2)
        dp.parallelize(model, dp.ZeRO2(comm_hook=dp.compression.build_hook("int8")), mesh=mesh)
        return dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2), None
    if name == "ddp-diloco-int8":
        mesh = dp.init_mesh(2)
        dp.parallelize(model, "ddp", group=mesh.shard_group)
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
        chosen = choose_outer(2, 2, "adamw")  # the table's for 2 replicas, plain
        outer = partial(torch.optim.SGD, lr=chosen.lr, momentum=chosen.momentum, nesterov=True)
        averager = dp.DiLoCo(
            model, optimizer, 2, group=mesh.replicate_group, outer_optimizer=outer, compress="int8"
        )
        return optimizer, averager
    if name == "zero1-local-sgd":
        mesh = dp.init_mesh(2)
        dp.parallelize(model, "zero1", group=mesh.shard_group)
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
        return optimizer, dp.LocalSGD(model, optimizer, 2, group=mesh.replicate_group)
    precision = dp.MixedPrecision(param_dtype=torch.bfloat16)
    dp.parallelize(model, dp.ZeRO3(precision=precision))
    return dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2), None


PLAIN_DILOCO = {"fragments": 1, "overlap": 0, "outer_warmup": 0}  # not the streaming recipe
RECIPES = {
    "zero2-hsdp-int8": dp.Recipe(strategy="zero2", shard_size=2, compress="int8"),
    "ddp-diloco-int8": dp.Recipe(
        strategy="ddp", shard_size=2, diloco=2, outer_compress="int8", **PLAIN_DILOCO
    ),
    "zero1-local-sgd": dp.Recipe(strategy="zero1", shard_size=2, local_sgd=2),
    "zero3-bf16": dp.Recipe(strategy="zero3", precision="bf16-params"),
}


def _train(model, optimizer, averager, rank):
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randint(0, 64, (2, 16), generator=g)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if averager is not None:
            averager.step()


def _world(world):
    out = {}
    for name, recipe in RECIPES.items():
        torch.manual_seed(0)
        mine = GPT(CONFIG)
        start = {k: v.clone() for k, v in mine.state_dict().items()}
        torch.manual_seed(0)
        theirs = GPT(CONFIG)
        composed = dp.compose(mine, recipe, torch.optim.AdamW, lr=1e-2)
        _train(mine, composed.optimizer, composed.averager, world.rank)
        optimizer, averager = _by_hand(name, theirs)
        _train(theirs, optimizer, averager, world.rank)
        a, b = dp.full_state_dict(mine), dp.full_state_dict(theirs)
        moved = max((a[k].float() - start[k].float()).abs().max().item() for k in a)
        assert moved > 1e-2, (name, moved)  # it trained
        out[name] = (
            max((a[k] - b[k]).abs().max().item() for k in a),
            type(composed.averager).__name__,
            composed.mesh is not None,
            dp.handle_of(mine).name,
        )
    return out


def test_compose_equals_the_pieces_by_hand():
    results = run_world(4, _world)
    for rank_result in results:
        assert rank_result["zero2-hsdp-int8"] == (0.0, "NoneType", True, "zero2")
        assert rank_result["ddp-diloco-int8"] == (0.0, "DiLoCo", True, "ddp")
        assert rank_result["zero1-local-sgd"] == (0.0, "LocalSGD", True, "zero1")
        assert rank_result["zero3-bf16"] == (0.0, "NoneType", False, "zero3")

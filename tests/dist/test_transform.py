"""`dp.compose` applies tensor parallelism, activation checkpointing, compile and data
parallelism in that order ([Note: composition]): a script gets what `dataparallel train` gets.

4 ranks. Each recipe trains 4 AdamW steps beside the same transforms applied by hand in that
order (the tensor-parallel split as the job made it before compose did: PyTorch's
`parallelize_module` block by block; `dp.checkpoint_activations`; `block.compile()`;
`dp.parallelize`; `dp.build_optimizer`), and both end bit-identical. The recipes' rules that
need the world or the mesh raise a `RecipeError` naming `tp` before the model changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.activation_checkpointing import is_checkpointed
from dataparallel.models import GPT, GPTConfig

from .harness import run_world

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
BF16 = dp.MixedPrecision(param_dtype=torch.bfloat16)


class Case(NamedTuple):
    recipe: dp.Recipe
    by_hand: tuple  # the transforms, in order: "split", "checkpoint", "compile", the strategy
    mesh_given: bool = False  # the test passes compose the ("dp", "tp") mesh, as the job does
    groups: bool = False  # param groups made on the model before compose, as the job makes them


CASES = {
    "tp2-ac-zero2-groups": Case(
        dp.Recipe(strategy="zero2", tp=2, activation_checkpointing=True),
        ("split", "checkpoint", "zero2"),
        groups=True,
    ),
    "tp2-ddp-bf16-mesh": Case(
        dp.Recipe(strategy="ddp", tp=2, precision="bf16-params"),
        ("split", dp.DDP(precision=BF16)),
        mesh_given=True,
    ),
    "ac-zero3": Case(
        dp.Recipe(strategy="zero3", activation_checkpointing=True), ("checkpoint", "zero3")
    ),
    "ac-compile-ddp": Case(
        dp.Recipe(strategy="ddp", activation_checkpointing=True, compile=True),
        ("checkpoint", "compile", "ddp"),
        groups=True,
    ),
}


def _groups(model) -> list[dict]:
    """The job's kind of param groups: matrices decayed, the rest not."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _split_as_the_job_did(model, tp_mesh) -> None:
    """The job's split before compose made it (train/tensor_parallel.py's `split_gpt`)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def _by_hand(model, steps, mesh, groups: bool):
    """The transforms one by one, in compose's order; the optimizer on what each rank holds."""
    for step in steps:
        if step == "split":
            _split_as_the_job_did(model, mesh["tp"])
        elif step == "checkpoint":
            dp.checkpoint_activations(model)
        elif step == "compile":
            for block in model.blocks:
                block.compile()
        else:
            dp.parallelize(model, step, mesh=mesh["dp"] if "split" in steps else None)
    params = _groups(model) if groups else None
    return dp.build_optimizer(model, torch.optim.AdamW, params=params, lr=1e-2)


def _train(model, optimizer, data_rank: int) -> None:
    g = torch.Generator().manual_seed(data_rank)  # tp peers read the same batch
    for _ in range(4):
        x = torch.randint(0, 64, (2, 16), generator=g)
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _case(world, mesh, case: Case) -> tuple:
    recipe, groups = case.recipe, case.groups
    torch.manual_seed(0)
    mine = GPT(CONFIG)
    start = {k: v.clone() for k, v in mine.state_dict().items()}
    torch.manual_seed(0)
    theirs = GPT(CONFIG)
    whole = sum(p.numel() for p in theirs.parameters())
    params = _groups(mine) if groups else None  # made before compose, as the job makes them
    given = mesh if case.mesh_given else None
    composed = dp.compose(mine, recipe, torch.optim.AdamW, params=params, mesh=given, lr=1e-2)
    split = recipe.tp > 1
    data_rank = world.rank // 2 if split else world.rank
    _train(mine, composed.optimizer, data_rank)
    _train(theirs, _by_hand(theirs, case.by_hand, mesh, groups), data_rank)
    a, b = dp.full_state_dict(mine), dp.full_state_dict(theirs)
    moved = max((a[k].float() - start[k].float()).abs().max().item() for k in a)
    assert moved > 1e-2, moved  # it trained
    local = sum(p.numel() for p in mine.parameters()) / whole
    compiled = [block._compiled_call_impl is not None for block in mine.blocks]
    return (
        max((a[k].float() - b[k].float()).abs().max().item() for k in a),
        tuple(composed.device_mesh.shape) if composed.device_mesh is not None else None,
        local < 0.9,  # the split linears hold their part
        is_checkpointed(mine),
        all(compiled),
        dp.handle_of(mine).name,
    )


def _refusals() -> dict:
    """Each a RecipeError naming tp, raised before the model changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    flat = init_device_mesh("cpu", (4,))
    wide = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, recipe, given in [
        ("1-D mesh", dp.Recipe(tp=2, activation_checkpointing=True), flat),
        ("tp size", dp.Recipe(tp=2, activation_checkpointing=True), wide),
        ("world", dp.Recipe(tp=3, activation_checkpointing=True), None),
    ]:
        model = GPT(CONFIG)
        try:
            dp.compose(model, recipe, mesh=given)
        except dp.RecipeError as error:
            split = any(isinstance(p, DTensor) for p in model.parameters())
            untouched = not is_checkpointed(model) and not split
            out[name] = (error.field, str(error).split(";")[0], untouched)
    return out


def _world(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {name: _case(world, mesh, case) for name, case in CASES.items()}
    return out, _refusals()


def test_compose_transforms_in_order_as_by_hand():
    results = run_world(4, _world, timeout=600)
    for cases, refusals in results:
        assert len(cases) == 4
        assert cases["tp2-ac-zero2-groups"] == (0.0, (2, 2), True, True, False, "zero2")
        assert cases["tp2-ddp-bf16-mesh"] == (0.0, (2, 2), True, False, False, "ddp")
        assert cases["ac-zero3"] == (0.0, None, False, True, False, "zero3")
        assert cases["ac-compile-ddp"] == (0.0, None, False, True, True, "ddp")
        assert refusals == {
            "1-D mesh": ("tp", "Recipe.tp: the mesh given is 1-D, unnamed, not ('dp', 'tp')", True),
            "tp size": ("tp", "Recipe.tp: 2 differs from the mesh's 'tp' size 1", True),
            "world": ("tp", "Recipe.tp: 3 does not divide the 4 ranks", True),
        }

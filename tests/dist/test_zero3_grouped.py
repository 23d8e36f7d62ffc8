"""ZeRO-3's grouped units across real ranks ([Note: grouped units] in strategies/zero3/plan.py):
parity with one process, the collectives of a step, the gathered memory, and one error for a
forward that skips or reorders a module of a grouped unit.

Everything multi-rank runs in one spawned world per world size, as a grid of sub-cases.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.models import GPT, GPTConfig

from .harness import RankError, run_world
from .models import (
    MODELS,
    OPTIMIZERS,
    batch,
    build,
    loss_fn,
    max_state_diff,
    reference_loss,
    train_chunks,
    user_checkpointed,
)
from .zero3_parity import PER_RANK, TOL, train_case

# Five blocks of 12,416 parameters (width 32, no biases): 20,000 groups them as 0-1, 2-3, 4
MODELS["deep"] = (
    lambda: GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=5, n_head=2, n_embd=32,
                          tie_weights=False, bias=False)),
    "tokens",
)  # fmt: skip
MODELS["deep tied"] = (
    lambda: GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=32,
                          tie_weights=True, bias=False)),
    "tokens",
)  # fmt: skip


def shared_blocks():
    """gpt "deep" with weights shared between blocks: block 1's query with block 0's (one
    grouped unit owns it) and block 4's with block 3's (two units: the root owns it)."""
    model = MODELS["deep"][0]()
    model.blocks[1].attn.q.weight = model.blocks[0].attn.q.weight
    model.blocks[4].attn.q.weight = model.blocks[3].attn.q.weight
    return model


MODELS["deep shared"] = (shared_blocks, "tokens")
GROUPED = 20_000
BLOCK = 12_416


def parity_grid(world) -> dict:
    out = {}
    for model_name in ("deep", "deep tied", "deep shared"):
        for opt_name in ("sgd", "adamw"):
            policy = dp.ZeRO3(min_unit_params=GROUPED)
            out[model_name, opt_name] = train_case(world, model_name, opt_name, policy)
    if world.world_size > 2:
        return out
    variants = {
        "no reshard": (dp.ZeRO3(min_unit_params=GROUPED, reshard_after_forward=False), {}),
        "prefetch 2": (dp.ZeRO3(min_unit_params=GROUPED, prefetch=2), {}),
        "check always": (dp.ZeRO3(min_unit_params=GROUPED, check_order="always"), {}),
        "all_reduce": (dp.ZeRO3(min_unit_params=GROUPED, reduce="all_reduce"), {}),
        "no_sync x3": (dp.ZeRO3(min_unit_params=GROUPED), {"accum": 3}),
        "clip 0.05": (dp.ZeRO3(min_unit_params=GROUPED), {"clip": 0.05}),
        "one unit": (dp.ZeRO3(min_unit_params=10**9), {}),
    }
    for name, (policy, extra) in variants.items():
        out["deep", "adamw", name] = train_case(world, "deep", "adamw", policy, **extra)
    return out


def collectives_case(world, min_unit_params: int) -> dict:
    """The unit collectives of the third step, by kind, and the largest gathered unit."""
    tracer = dp.Tracer(enabled=True)
    torch.manual_seed(0)
    model = dp.parallelize(
        MODELS["deep"][0](), dp.ZeRO3(min_unit_params=min_unit_params), tracer=tracer
    )
    x = torch.randint(0, 32, (4, 16))
    for _ in range(3):
        tracer.clear()
        model(x).sum().backward()
    events = tracer.events
    return {
        "gathers": sum(e.name == "gather_start" for e in events),
        "reduces": sum(e.name == "reduce_start" for e in events),
        "largest": dp.memory_report(model)["largest_gathered_unit"],
        "block": sum(p.numel() for p in model.blocks[0].parameters()),
    }


def checkpointed(model, how: str):
    """Each block recomputed in backward: `dp.checkpoint_activations`, or `checkpoint(block,
    x)` in the model's forward as a user writes it (the block's hooks recomputed too)."""
    if how == "transform":
        dp.checkpoint_activations(model)
        return model
    return user_checkpointed(model)


def on_meta(values: dict):
    """gpt "deep" built on the meta device, and a `materialize` that fills it from `values`,
    counting its calls."""
    with torch.device("meta"):
        model = MODELS["deep"][0]()
    names = {id(p): name for name, p in model.named_parameters()}
    calls = []

    def fill(params):
        calls.append(len(params))
        for p in params:
            value = values[names[id(p)]].clone()
            torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))

    return model, fill, calls


def feature_case(world, how: str, mesh=None, steps: int = 4) -> dict:
    """gpt "deep" in units of two blocks with one feature on, against one process (`how`:
    "transform"/"whole" checkpointing, "compile" after parallelize, "meta" materialize, "mesh")."""
    rank, n = world.rank, world.world_size
    cls, kwargs = OPTIMIZERS["adamw"]
    reference = build("deep", seed=100)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    policy, calls = dp.ZeRO3(min_unit_params=GROUPED), None
    if how == "meta":
        model, fill, calls = on_meta(reference.state_dict())
        policy = dp.ZeRO3(min_unit_params=GROUPED, materialize=fill)
    else:
        model = build("deep", seed=100 + rank)  # rank 0's weights win
    if how in ("transform", "whole"):
        checkpointed(model, how)
    dp.parallelize(model, policy, mesh=mesh)
    run = torch.compile(model) if how == "compile" else model
    opt = dp.build_optimizer(model, cls, **kwargs)
    ref_opt = cls(reference.parameters(), **kwargs)
    for step in range(steps):
        x, y = batch("deep", step, PER_RANK * n)
        reference_loss("deep", reference, x, y, step, n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn("deep", run, x.chunk(n)[rank], y.chunk(n)[rank], step, rank).backward()
        opt.step()
        opt.zero_grad()
    state = dp.full_state_dict(model)
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    moved = max((state[k] - v).abs().max().item() for k, v in start.items())
    return {"diff": diff, "moved": moved, "materialize_calls": calls}


def bf16_case(world) -> float:
    """bf16 parameters: units of two blocks against one block per unit, max |difference|."""
    states = []
    for min_unit_params in (GROUPED, 0):
        precision = dp.MixedPrecision(param_dtype=torch.bfloat16)
        model = build("deep", seed=100)
        dp.parallelize(model, dp.ZeRO3(min_unit_params=min_unit_params, precision=precision))
        states.append(train_chunks(model, "deep", world, 4, PER_RANK))
    return max_state_diff(states[0], states[1])


def checkpoint_case(world) -> dict:
    """Weights and optimizer state out of grouped units in plain form, and back into units of
    one block, trained on: against one process."""
    rank, n = world.rank, world.world_size
    cls, kwargs = OPTIMIZERS["adamw"]
    reference = build("deep", seed=5)
    ref_opt = cls(reference.parameters(), **kwargs)
    first = dp.parallelize(build("deep", seed=5), dp.ZeRO3(min_unit_params=GROUPED))
    second = dp.parallelize(build("deep", seed=9), dp.ZeRO3(min_unit_params=0))
    first_opt, second_opt = (dp.build_optimizer(m, cls, **kwargs) for m in (first, second))
    for step in range(6):
        model, opt = (first, first_opt) if step < 3 else (second, second_opt)
        if step == 3:
            dp.load_full_state_dict(second, dp.full_state_dict(first))
            plain = dp.optimizer_state_dict(first, first_opt)
            dp.load_optimizer_state_dict(second, second_opt, plain)
        x, y = batch("deep", step, PER_RANK * n)
        reference_loss("deep", reference, x, y, step, n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn("deep", model, x.chunk(n)[rank], y.chunk(n)[rank], step, rank).backward()
        opt.step()
        opt.zero_grad()
    state = dp.full_state_dict(second)
    return max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())


FEATURES = ("transform", "whole", "compile", "meta")


def all_cases(world) -> dict:
    out = {"parity": parity_grid(world)}
    if world.world_size == 2:
        out["collectives"] = {m: collectives_case(world, m) for m in (0, GROUPED)}
        out["features"] = {how: feature_case(world, how) for how in FEATURES}
        out["bf16"] = bf16_case(world)
        out["checkpoint"] = checkpoint_case(world)
    return out


def mesh_case(world) -> dict:
    return feature_case(world, "mesh", mesh=dp.init_mesh(2))  # 2 replicas x 2 shards


@functools.cache
def world_results(world_size: int) -> list[dict]:
    return run_world(world_size, all_cases, timeout=300)


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_units_equal_one_process_and_ddp(world_size):
    for results in world_results(world_size):
        # 3 models x 2 optimizers; the 7 variants in the 2-rank world only (3 ranks: uneven)
        assert len(results["parity"]) == {2: 3 * 2 + 7, 3: 3 * 2}[world_size], results
        for case, diffs in results["parity"].items():
            assert diffs["vs_reference"] < TOL and diffs["vs_ddp"] < TOL, (case, diffs)


def test_grouped_units_make_fewer_collectives_and_gather_more():
    for results in world_results(2):
        one, grouped = results["collectives"][0], results["collectives"][GROUPED]
        # forward: the root and every unit; backward: every unit but the one that ran last
        assert (one["gathers"], one["reduces"]) == (1 + 5 + 4, 1 + 5), one
        assert (grouped["gathers"], grouped["reduces"]) == (1 + 3 + 2, 1 + 3), grouped
        assert one["block"] == BLOCK and one["largest"] == BLOCK * 4, (
            one
        )  # fp32, 12,416 divides by 2
        assert grouped["largest"] == 2 * BLOCK * 4, grouped


def test_grouped_units_with_checkpointing_compile_meta_bf16_and_checkpoints():
    for results in world_results(2):
        features = results["features"]
        assert len(features) == 4, features
        for how, case in features.items():
            assert case["diff"] < TOL and case["moved"] > 1e-3, (how, case)
        # the root and the three units, each materialized just before it is sharded
        assert features["meta"]["materialize_calls"] == [5, 2 * 10, 2 * 10, 10], features
        # the same bf16 arithmetic, gathered and reduced in other units
        assert results["bf16"] < 1e-6, results["bf16"]
        assert results["checkpoint"] < TOL, results["checkpoint"]


def test_grouped_units_on_a_two_by_two_mesh():
    for result in run_world(4, mesh_case, timeout=300):
        assert result["diff"] < TOL, result


# -- a forward that does not run a grouped unit's modules once each, in order -----------------
class Stack(nn.Module):
    """Four layers in a ModuleList, run in the order `order` names (a module of 72 parameters:
    min_unit_params=100 groups them as 0-1 and 2-3)."""

    def __init__(self, order):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.order = order

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


def _run_stack(world, order):
    torch.manual_seed(0)
    model = dp.parallelize(Stack(order), dp.ZeRO3(min_unit_params=100))
    model(torch.randn(2, 8)).sum().backward()
    return True


ORDERS = {
    # the last module of unit 2-3 skipped: the forward ends with the unit open
    (0, 1, 2): "ran 'layers.2' but not 'layers.3' before the end of the forward",
    # the middle of unit 0-1 skipped: unit 2-3 starts while it is open
    (0, 2, 3): "ran 'layers.0' but not 'layers.1' before unit 'layers.2-3' started",
    # reordered inside a unit
    (1, 0, 2, 3): "module 'layers.1' ran where 'layers.0' was due",
    # a module run twice in a row
    (0, 0, 1, 2, 3): "module 'layers.0' ran where 'layers.1' was due",
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_grouped_unit_run_out_of_order_stops_with_one_error(order):
    with pytest.raises(RankError) as raised:
        run_world(2, _run_stack, order, timeout=60)
    assert sorted(raised.value.errors) == [0, 1]
    for text in raised.value.errors.values():
        line = text.strip().splitlines()[-1]
        assert ORDERS[order] in line and "min_unit_params=0" in line, line


def test_the_stack_runs_in_order_and_twice():
    assert len(ORDERS) == 4
    assert run_world(2, _run_stack, (0, 1, 2, 3, 0, 1, 2, 3)) == [True, True]


def test_min_unit_params_is_checked():
    for bad in (-1, 1.5, "100", True):
        with pytest.raises(ValueError, match="min_unit_params="):
            dp.ZeRO3(min_unit_params=bad)

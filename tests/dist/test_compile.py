"""torch.compile on every strategy: whole model before or after `parallelize`, and per block.

Each sub-case trains a small GPT for a few AdamW steps on 2 ranks and compares with one process
on the global batch (eager): the compiler reorders arithmetic, so the bound is 1e-4 (eager runs
agree to ~1e-7). Also counted: the graphs the compiler made and its graph breaks, so a hook of
ours that starts breaking a block's graph shows up here ([Note: compile] in
strategies/zero3/strategy.py).
"""

from __future__ import annotations

import copy
import functools

import torch
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.models import GPT, GPTConfig

from .harness import run_world

STEPS = 3
# Compiled against eager under bf16 compute (SGD): the compiler keeps some bf16 intermediates in
# fp32, so the gradients differ by bf16 rounding (2**-8 relative).
BF16_BOUND = 1e-3
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def _policy(strategy: str, precision: str):
    if precision == "fp32":
        return strategy
    mp = dp.MixedPrecision(param_dtype=torch.bfloat16)
    return {"ddp": dp.DDP, "zero1": dp.ZeRO1, "zero2": dp.ZeRO2, "zero3": dp.ZeRO3}[strategy](
        precision=mp
    )


def _optimizer(model, precision):
    """AdamW in fp32; under bf16, SGD: Adam's normalised step turns the sign of a near-zero
    gradient's rounding noise into a full lr-sized move, which would hide what compiling does."""
    if precision == "fp32":
        return dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    return dp.build_optimizer(model, torch.optim.SGD, lr=0.1)


def _train(model, optimizer, rank, world_size, steps):
    g = torch.Generator().manual_seed(1)
    per = 4 // world_size
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=g)
        y = torch.randint(0, 64, (4, 16), generator=g)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        with torch.autocast("cpu", torch.bfloat16, enabled=False):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _case(world, strategy: str, order: str, precision: str, shard_size: int | None):
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    mesh = dp.init_mesh(shard_size) if shard_size else None
    policy = _policy(strategy, precision)
    if order == "before":
        compiled = torch.compile(model)
        dp.parallelize(model, policy, mesh=mesh)
    elif order == "after":
        dp.parallelize(model, policy, mesh=mesh)
        compiled = torch.compile(model)
    else:  # per block
        dp.parallelize(model, policy, mesh=mesh)
        for block in model.blocks:
            block.compile()
        compiled = model
    optimizer = _optimizer(model, precision)
    _train(compiled, optimizer, world.rank, world.world_size, STEPS)
    if precision == "fp32":  # one process on the global batch
        reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        _train(reference, reference_opt, 0, 1, STEPS)
    else:  # the same strategy and precision policy, eager (its parity with one process under
        # the policy is tested in test_core.py): what compiling changes
        dp.parallelize(reference, policy, mesh=mesh)
        reference_opt = _optimizer(reference, precision)
        _train(reference, reference_opt, world.rank, world.world_size, STEPS)
        reference = type(
            "Plain", (), {"state_dict": lambda self, r=reference: dp.full_state_dict(r)}
        )()
    full = dp.full_state_dict(model)
    diff = max(
        (full[k].float() - v.float()).abs().max().item() for k, v in reference.state_dict().items()
    )
    breaks = sum(dynamo.utils.counters["graph_break"].values())
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    return diff, breaks, graphs


def _grid(world, cases):
    return [_case(world, *case) for case in cases]


FP32 = [
    (s, o, "fp32", None)
    for s in ("ddp", "zero1", "zero2", "zero3")
    for o in ("before", "after", "block")
]
MIXED = [(s, "after", "bf16", None) for s in ("ddp", "zero1", "zero2", "zero3")]


def _rest_world(world):
    model = GPT(CONFIG)
    dp.parallelize(model, "zero3")
    compiled = torch.compile(model)
    optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    _train(compiled, optimizer, world.rank, world.world_size, 2)
    at_rest = all(torch.isnan(p).all().item() for p in model.blocks[0].parameters())
    return at_rest, dp.memory_report(model, optimizer)


def _two_ranks(world) -> dict:
    """Every 2-rank case in one world: one start-up and one warm-up of the compiler, not three
    (the compile at rest first, in a fresh process as alone; each grid case resets dynamo)."""
    rest = _rest_world(world)
    return {"fp32": _grid(world, FP32), "bf16": _grid(world, MIXED), "rest": rest}


@functools.cache
def two_ranks() -> dict:
    return run_world(2, _two_ranks, timeout=600)[0]


def test_compile_every_strategy_matches_one_process():
    results = two_ranks()["fp32"]
    assert len(results) == 4 * 3, results  # 4 strategies x 3 placements of compile
    for case, (diff, breaks, graphs) in zip(FP32, results, strict=True):
        assert diff < 1e-4, (case, diff)
        assert graphs >= 1, (case, graphs)  # it did compile
        if case[1] == "block":
            # A block's forward is one graph per block (the same code: compiled once).
            assert breaks == 0, (case, breaks)


def test_compile_under_mixed_precision_and_a_mesh():
    results = two_ranks()["bf16"]
    assert len(results) == 4, results
    for case, (diff, _, graphs) in zip(MIXED, results, strict=True):
        assert diff < BF16_BOUND, (case, diff)
        assert graphs >= 1
    mesh = [("zero3", "after", "fp32", 2), ("zero2", "block", "fp32", 2)]
    results = run_world(4, _grid, mesh, timeout=600)[0]
    assert len(results) == 2, results
    for case, (diff, _, _) in zip(mesh, results, strict=True):
        assert diff < 1e-4, (case, diff)


def test_compiled_zero3_holds_only_shards_between_steps():
    """[Note: parameters at rest]: after compiled steps the units are freed again."""
    at_rest, report = two_ranks()["rest"]
    assert at_rest
    full = sum(p.numel() for p in GPT(CONFIG).parameters()) * 4
    assert report["params"] < 0.75 * full  # shards (half) plus the largest gathered unit freed

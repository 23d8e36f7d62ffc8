"""ZeRO-3 across real ranks: parity with one process, with our DDP and with PyTorch's FSDP2;
memory against the theory; prefetch overlap in a trace; checkpoints in plain form.

Everything multi-rank runs in one spawned world per world size (`world_results`), as a grid
of sub-cases; the test functions below only read its results.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.models import GPT, GPTConfig
from dataparallel.models.gpt import Block
from dataparallel.strategies.zero3.plan import plan_units
from dataparallel.strategies.parts.layout import ShardLayout

from .harness import RankError, run_world
from .models import OPTIMIZERS, MoE, WithMoE, batch, build, loss_fn, reference_loss
from .zero3_parity import PER_RANK, STEPS, TOL, max_diff, train_case


def parity_grid(world) -> dict:
    out = {}
    for model_name, wrap in (("transformer", None), ("tied", None), ("odd", (nn.Linear,))):
        for opt_name in ("sgd", "adamw"):
            out[model_name, opt_name] = train_case(world, model_name, opt_name, dp.ZeRO3(wrap=wrap))
    if world.world_size > 2:
        return out  # the variants below run in the 2-rank world only, to keep the suite fast
    variants = {
        # the tied weight is reached from the tok_emb unit and the root: it goes to the root
        "tied, embedding unit": ("tied", dp.ZeRO3(wrap=(nn.Embedding, Block)), {}),
        "all_reduce, no prefetch, no reshard": (
            "transformer",
            dp.ZeRO3(reduce="all_reduce", prefetch=False, reshard_after_forward=False),
            {},
        ),
        # gloo's own all-gather, and all-reduce for the gradients ("auto" without pairwise)
        "gloo's collectives": ("transformer", dp.ZeRO3(), {"pairwise": False}),
        # two units gathered ahead, in forward and in backward
        "prefetch 2": ("transformer", dp.ZeRO3(prefetch=2), {}),
        "no_sync x3": ("transformer", dp.ZeRO3(), {"accum": 3}),
        "clip 0.05": ("transformer", dp.ZeRO3(), {"clip": 0.05}),
        "unused params": ("branchy", dp.ZeRO3(), {}),
        "bf16 autocast": ("transformer", dp.ZeRO3(), {"autocast": True}),
    }
    for name, (model_name, policy, extra) in variants.items():
        out[model_name, "adamw", name] = train_case(world, model_name, "adamw", policy, **extra)
    return out


def memory_case(world, param_dtype) -> dict:
    """Bytes after a step of AdamW on a GPT, with the theory's numbers next to them."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=64)
    model = dp.parallelize(GPT(config), dp.ZeRO3(precision=dp.MixedPrecision(param_dtype=param_dtype)))
    opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        opt.step()
    psi = model.num_parameters()  # the tied weight once
    # the largest unit: the three blocks of 50k parameters, one unit under min_unit_params'
    # default (zero3/plan.py [Note: grouped units]; bf16: without their norms, units of their own)
    largest = sum(p.numel() for p in model.blocks.parameters())
    itemsize = (param_dtype or torch.float32).itemsize
    return {
        "report": dp.memory_report(model, opt),
        "psi": psi,
        "theory_sharded": 16 * psi / world.world_size,
        "theory_largest_unit": largest * itemsize,
    }


def prefetch_case(world) -> dict:
    """A trace of the second step: when each unit's gather started relative to compute."""
    tracer = dp.Tracer(enabled=True)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=64)
    # each block its own unit (min_unit_params=0): the overlap of one unit's gather with the
    # previous unit's compute is what is traced
    model = dp.parallelize(GPT(config), dp.ZeRO3(min_unit_params=0), tracer=tracer)
    x = torch.randint(0, 64, (4, 16))
    for _ in range(2):
        tracer.clear()
        model(x).sum().backward()
    events = tracer.events
    forward_done = next(
        i for i, e in enumerate(events) if e.name == "forward_end" and e.args["unit"] == 0
    )
    gathers = [
        (i, e.args["unit"], e.args["prefetch"])
        for i, e in enumerate(events)
        if e.name == "gather_start"
    ]

    def first(name, unit, after=0):
        return next(
            i
            for i, e in enumerate(events)
            if i >= after and e.name == name and e.args.get("unit") == unit
        )

    blocks = range(1, 5)
    forward_gathers = [g for g in gathers if g[0] < forward_done]
    backward_gathers = [g for g in gathers if g[0] > forward_done]
    return {
        "forward_on_demand": [u for _, u, pre in forward_gathers if not pre],
        "backward_on_demand": [u for _, u, pre in backward_gathers if not pre],
        # block k's gather starts before block k-1's forward ends: it overlaps that compute
        "forward_overlapped": sum(
            first("gather_start", k) < first("forward_end", k - 1) for k in blocks if k > 1
        ),
        # in backward, block k-1's gather starts before block k's reduction
        "backward_overlapped": sum(
            first("gather_start", k - 1, forward_done) < first("reduce_start", k)
            for k in blocks
            if k > 1
        ),
        "reduces": sum(e.name == "reduce_start" for e in events),
    }


def checkpoint_case(world) -> dict:
    """Full weights into a plain module; optimizer state in plain form, both directions."""
    rank, n = world.rank, world.world_size
    cls, kwargs = OPTIMIZERS["adamw"]
    model = dp.parallelize(build("transformer", seed=5), dp.ZeRO3())
    opt = dp.build_optimizer(model, cls, **kwargs)
    reference = build("transformer", seed=5)
    ref_opt = cls(reference.parameters(), **kwargs)

    def step(k, model, opt):
        x, y = batch("transformer", k, PER_RANK * n)
        reference_loss("transformer", reference, x, y, k, n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn("transformer", model, x.chunk(n)[rank], y.chunk(n)[rank], k, rank).backward()
        opt.step()
        opt.zero_grad()

    for k in range(3):
        step(k, model, opt)
    plain = build("transformer", seed=99)
    plain.load_state_dict(dp.full_state_dict(model))
    x, _ = batch("transformer", 0, 2)
    out = {"plain_module_output_diff": (plain(x) - reference(x)).abs().max().item()}
    ours, theirs = dp.optimizer_state_dict(model, opt), ref_opt.state_dict()
    out["optimizer_state_diff"] = max(
        (torch.as_tensor(ours["state"][i][key]) - torch.as_tensor(v)).abs().max().item()
        for i, entry in theirs["state"].items()
        for key, v in entry.items()
    )
    out["optimizer_state_keys_equal"] = ours["state"].keys() == theirs["state"].keys()
    # the reverse: a plain (one-process) checkpoint into a fresh ZeRO-3 model, then train on
    fresh = dp.parallelize(build("transformer", seed=42), dp.ZeRO3(wrap=(nn.Linear,)))
    fresh_opt = dp.build_optimizer(fresh, cls, **kwargs)
    dp.load_full_state_dict(fresh, reference.state_dict())
    dp.load_optimizer_state_dict(fresh, fresh_opt, ref_opt.state_dict())
    for k in range(3, 6):
        step(k, fresh, fresh_opt)
    out["resumed_diff"] = max_diff(dp.full_state_dict(fresh), reference.state_dict())
    return out


def against_fully_shard(world) -> dict:
    """ZeRO-3 and torch.distributed.fsdp.fully_shard, from the same weights, on the same data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world.world_size,))
    rank, n = world.rank, world.world_size
    out, states = {}, {}
    for opt_name, bf16 in (("sgd", False), ("adamw", False), ("adamw", True)):
        cls, kwargs = OPTIMIZERS[opt_name]
        dtype = torch.bfloat16 if bf16 else None
        ours = dp.parallelize(build("transformer", seed=7), dp.ZeRO3(precision=dp.MixedPrecision(param_dtype=dtype)))
        theirs = build("transformer", seed=7)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in theirs.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(theirs, mesh=mesh, mp_policy=mp)
        pairs = [
            (ours, dp.build_optimizer(ours, cls, **kwargs)),
            (theirs, cls(theirs.parameters(), **kwargs)),
        ]
        for step in range(STEPS):
            x, y = batch("transformer", step, PER_RANK * n)
            for model, opt in pairs:
                logits = model(x.chunk(n)[rank]).float()
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), y.chunk(n)[rank].flatten()
                ).backward()
                opt.step()
                opt.zero_grad()
        their_state = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        states[opt_name, "bf16" if bf16 else "fp32"] = dp.full_state_dict(ours)
        out[opt_name, "bf16" if bf16 else "fp32"] = max_diff(
            states[opt_name, "bf16" if bf16 else "fp32"], their_state
        )
    # bf16 really computed in bf16: its weights moved away from the fp32 run's
    out["bf16 vs fp32 run"] = max_diff(states["adamw", "bf16"], states["adamw", "fp32"])
    return out


def subset_optimizer_case(world) -> list[float]:
    """An optimizer over one parameter of a unit: its gradient must not pile up across steps
    while the unit's other pieces keep theirs (the shard is then reused, not rebuilt)."""
    model = dp.parallelize(build("transformer", seed=5), dp.ZeRO3())
    opt = dp.build_optimizer(
        model, torch.optim.SGD, params=[model.blocks[0].attn.q.weight], lr=0.0
    )
    x, y = batch("transformer", 0, 4)
    norms = []
    for _ in range(3):
        loss_fn("transformer", model, x, y, 0, world.rank).backward()
        pieces = [p.grad for p in opt.param_groups[0]["params"] if p.grad is not None]
        norms.append(sum(g.pow(2).sum().item() for g in pieces) ** 0.5)  # 0 if all elsewhere
        opt.step()
        opt.zero_grad()
    return norms


def all_cases(world) -> dict:
    out = {
        "parity": parity_grid(world),
        "memory fp32": memory_case(world, None),
        "memory bf16": memory_case(world, torch.bfloat16),
        "checkpoint": checkpoint_case(world),
    }
    if world.world_size == 2:
        out["fully_shard"] = against_fully_shard(world)
        out["prefetch"] = prefetch_case(world)
        out["subset"] = subset_optimizer_case(world)
    return out


@functools.cache
def world_results(world_size: int) -> list[dict]:
    return run_world(world_size, all_cases, timeout=300)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero3_equals_one_process_and_ddp(world_size):
    for results in world_results(world_size):
        # 3 models x 2 optimizers; the 8 variants in the 2-rank world only
        assert len(results["parity"]) == {2: 3 * 2 + 8, 3: 3 * 2}[world_size], results["parity"]
        for case, diffs in results["parity"].items():
            if case[-1] == "bf16 autocast":
                # the one-process reference sums the chunks' bf16 weight gradients in bf16
                # (autocast's cached cast); ranks sum fp32 gradients: only DDP compares exactly
                assert diffs["vs_ddp"] < TOL and diffs["vs_reference"] < 1e-2, (case, diffs)
            else:
                assert diffs["vs_reference"] < TOL and diffs["vs_ddp"] < TOL, (case, diffs)


def test_zero3_equals_torch_fully_shard():
    for results in world_results(2):
        diffs = results["fully_shard"]
        assert diffs["sgd", "fp32"] < TOL and diffs["adamw", "fp32"] < TOL, diffs
        assert diffs["adamw", "bf16"] < 1e-2 and diffs["bf16 vs fp32 run"] > 1e-4, diffs


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_within_five_percent_of_theory(world_size):
    for results in world_results(world_size):
        for key, with_unit in (("memory fp32", True), ("memory bf16", False)):
            m = results[key]
            report = m["report"]
            sharded = report["params"] + report["grads"] + report["optimizer_state"]
            assert abs(sharded / m["theory_sharded"] - 1) < 0.05, (key, m)
            assert abs(report["largest_gathered_unit"] / m["theory_largest_unit"] - 1) < 0.05, m
            if with_unit:  # fp32: 16 Psi / N plus the largest gathered unit
                total = sharded + report["largest_gathered_unit"]
                theory = m["theory_sharded"] + m["theory_largest_unit"]
                assert abs(total / theory - 1) < 0.05, (key, m)


def test_prefetch_overlaps_gathers_with_compute():
    for results in world_results(2):
        trace = results["prefetch"]
        # only the root is gathered on demand (at the start of forward); in backward, nothing
        assert trace["forward_on_demand"] == [0] and trace["backward_on_demand"] == [], trace
        assert trace["forward_overlapped"] == 3 and trace["backward_overlapped"] == 3, trace
        assert trace["reduces"] == 5, trace  # one per unit: the root and 4 blocks


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpoints_in_plain_form(world_size):
    for results in world_results(world_size):
        c = results["checkpoint"]
        assert c["plain_module_output_diff"] < TOL, c
        assert c["optimizer_state_keys_equal"] and c["optimizer_state_diff"] < TOL, c
        assert c["resumed_diff"] < TOL, c


# -- logic that needs no process group ---------------------------------------------------------
def test_flat_layout_pads_and_slices():
    layout = ShardLayout.pack([7, 5, 11], world_size=3)  # 23 elements -> 8 per rank, 1 of padding
    assert (layout.shard_numel, layout.numel) == (8, 24)
    assert [layout.local_slice(0, r) for r in range(3)] == [(0, 7, 0), (0, 0, 0), (0, 0, 0)]
    assert [layout.local_slice(1, r) for r in range(3)] == [(7, 8, 0), (0, 4, 1), (0, 0, 0)]
    assert [layout.local_slice(2, r) for r in range(3)] == [(0, 0, 0), (4, 8, 0), (0, 7, 4)]


def test_units_and_tied_weights():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    plans = plan_units(model, None)
    assert [p.name for p in plans] == ["", "blocks.0", "blocks.1"]
    assert any(p is model.tok_emb.weight for p in plans[0].params)  # tied to the head: root
    assert [p.name for p in plan_units(model, lambda m: isinstance(m, Block))] == [
        p.name for p in plans
    ]
    # tok_emb as a unit: its only weight is also the head's, so it goes to the root and the
    # tok_emb unit, left empty, is dropped
    plans = plan_units(model, (nn.Embedding, Block))
    assert [p.name for p in plans] == ["", "pos_emb", "blocks.0", "blocks.1"]
    assert sum(p.numel() for plan in plans for p in plan.params) == model.num_parameters()
    with pytest.raises(ValueError, match="no forward"):
        plan_units(model, (nn.ModuleList,))


def test_an_optimizer_over_part_of_a_unit_gets_fresh_gradients_each_step():
    results = [r["subset"] for r in world_results(2)]
    assert max(norms[0] for norms in results) > 0, results  # some rank holds the parameter
    for first, *later in results:
        assert all(abs(n - first) <= 1e-6 * first for n in later), results


def test_policy_errors_name_the_field():
    with pytest.raises(ValueError, match="precision="):
        dp.ZeRO3(precision=torch.float16)
    assert dp.ZeRO3(wrap=nn.Linear).wrap == (nn.Linear,)
    with pytest.raises(ValueError, match="prefetch="):
        dp.ZeRO3(prefetch=-1)
    with pytest.raises(ValueError, match="reduce="):
        dp.ZeRO3(reduce="ring")
    with pytest.raises(ValueError, match="param_dtype="):
        dp.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="wrap="):
        dp.ZeRO3(wrap=("Block",))


def _moe_world(world, wrap_layer: bool, diverge_at: int = 0, both: bool = False):
    torch.manual_seed(0)
    model = WithMoE()
    reference = copy.deepcopy(model)
    # each expert its own unit (not grouped: min_unit_params=0), or the layer one unit
    policy = dp.ZeRO3(wrap=(MoE,)) if wrap_layer else dp.ZeRO3(min_unit_params=0)
    dp.parallelize(model, policy)
    optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(4):
        # From step `diverge_at` on, rank r's rows all route to expert r (the sign of their
        # first feature); before it every row routes to expert 0.
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        x[:, 0] = -x[:, 0].abs() - 0.1
        if step >= diverge_at:
            x[3 if both else 2 :, 0] = -x[3 if both else 2 :, 0]  # both: rank 1 runs both
        mine = x[2 * world.rank : 2 * world.rank + 2]
        model(mine).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        reference(x).square().mean().backward()
        reference_opt.step()
        reference_opt.zero_grad()
    full = dp.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("diverge_at,both", [(0, False), (3, False), (3, True)])
def test_units_some_ranks_skip_stop_every_rank_with_one_error(diverge_at, both):
    """Each expert its own unit, ranks routing to different experts: every rank raises the
    same one-line error naming the units, at once, instead of hanging in mismatched gathers;
    from the first step (checked unit by unit), and once the order is steady (checked once per
    forward), where one rank runs another expert, or one more ([Note: same units on every
    rank])."""
    start = time.monotonic()
    with pytest.raises(RankError) as raised:
        run_world(2, _moe_world, False, diverge_at, both, timeout=60)
    assert time.monotonic() - start < 30
    assert sorted(raised.value.errors) == [0, 1]  # every rank
    for text in raised.value.errors.values():
        line = text.strip().splitlines()[-1]
        assert "ranks ran different units" in line
        ran = "rank 0: the end of forward" if both else "rank 0: 'moe.experts.0'"
        assert f"{ran}, rank 1: 'moe.experts.1'" in line
        assert "wrap the module that holds the optional ones" in line


def test_a_mixture_of_experts_wrapped_as_one_unit_matches_one_process():
    assert max(run_world(2, _moe_world, True)) < 1e-6

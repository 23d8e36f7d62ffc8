"""[Note: planner LoRA]: the planner's bytes of a LoRA fine-tune (a frozen base, trained
adapters) against what every strategy holds after a step (`dp.memory_report`), on 2 ranks.

The model is the suite's transformer with adapters on its attention's q and v, put there by
the planner's own `adapt` (the shapes peft gives them). fp32, and bf16 parameters with fp32
masters as a LoRA run has it: the base loaded in bf16, the adapters fp32 (peft's default).
Parameters (the frozen base in them), gradients and optimizer state with masters, to the byte,
on both ranks; Adam's 4-byte `step` per run is not per element and is taken out as
test_footprint.py does."""

from __future__ import annotations

import functools

import pytest
import torch

import dataparallel as dp
from dataparallel.models.lora import LoraSpec
from dataparallel.plan.inputs import PlanInputs, plan_recipe
from dataparallel.plan.lora import adapt
from dataparallel.plan.model import shape_of_module
from dataparallel.plan.profiles import get_profile
from dataparallel.plan.strategies import Candidate, footprint
from dataparallel.strategies.base import tensor_bytes

from .harness import run_world
from .models import batch, build

SPEC = LoraSpec(r=4, targets=("q", "v"))
PRECISIONS = {"fp32": None, "bf16-params": dp.MixedPrecision(param_dtype=torch.bfloat16)}
POLICIES = {"ddp": dp.DDP, "zero1": dp.ZeRO1, "zero2": dp.ZeRO2, "zero3": dp.ZeRO3}


def adapted(precision_name: str) -> torch.nn.Module:
    model = build("transformer", 0)
    if precision_name != "fp32":
        model = model.to(torch.bfloat16)  # the base as a LoRA run loads it
    adapt(model, SPEC, "transformer")
    for name, module in model.named_modules():
        if name.endswith(("lora_A", "lora_B")):
            module.float()  # peft keeps the adapters in fp32
    return model


def measure(world) -> dict:
    out = {}
    hw = get_profile("cpu-2core")
    for precision_name, precision in PRECISIONS.items():
        for name, policy_cls in POLICIES.items():
            model = adapted(precision_name)
            shape = shape_of_module(model, name="transformer+lora")
            inputs = PlanInputs(ranks=2, recipe=plan_recipe(precision=precision_name))
            size = 1 if name == "ddp" else 2
            f = footprint(Candidate(strategy=name, shard_size=size), shape, inputs, hw)
            model = dp.parallelize(model, policy_cls(precision=precision))
            opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
            x, y = batch("transformer", world.rank, 2)
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
            opt.step()
            report = dp.memory_report(model, opt)
            steps = tensor_bytes(s["step"] for s in opt.state.values() if "step" in s)
            out[precision_name, name] = {
                "planned": (f.params, f.grads, f.optimizer + f.masters),
                "held": (report["params"], report["grads"], report["optimizer_state"] - steps),
                "frozen": f.frozen,
                "trained": shape.params,
            }
    return out


@functools.cache
def results() -> list[dict]:
    return run_world(2, measure, timeout=300)


@pytest.mark.parametrize("strategy", list(POLICIES))
def test_the_planned_lora_bytes_are_what_the_strategy_holds(strategy):
    ranks = results()
    assert len(ranks) == 2
    cases = [(rank, k, v) for rank, r in enumerate(ranks) for k, v in r.items() if k[1] == strategy]
    assert len(cases) == 2 * len(PRECISIONS)
    for rank, key, row in cases:
        assert row["frozen"] > 0 and row["trained"] == 2 * 2 * 4 * (32 + 32), (rank, key, row)
        assert row["planned"] == row["held"], (rank, key, row)


# `dataparallel plan --dry-run --lora`: the real engine on the fake process group, in this
# process, over a LoRA model built as the plan builds it ([Note: dry run of a plan]).


@pytest.fixture
def no_world_left():
    dp.destroy()  # as tests/dist/test_dryrun_edges.py: a world left by another module goes first
    yield
    dp.destroy()


def test_a_lora_dry_run_holds_and_sends_what_the_plan_says_at_1024_ranks(no_world_left):
    """Every strategy: the frozen base in the parameters (whole, or ZeRO-3's shards of its
    frozen units), the collectives (ZeRO-3's frozen units' all-gathers among them) and the
    largest gathered unit (a frozen one), to the byte; the peak within 2%."""
    from dataparallel.plan.dry_render import render
    from dataparallel.plan.dry_run import dry_run

    runs = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        result = dry_run("gpt-small", ranks=1024, strategy=strategy, precision="bf16-params",
                         seq_len=64, lora="r=4,targets=q,v")  # fmt: skip
        assert result.differences() == [], render(result)
        assert result.plan.model.frozen > 0 and result.row.memory.frozen > 0
        runs[strategy] = result
        for run in result.runs:
            assert run.held["params"] >= result.row.memory.frozen
            assert run.peak and abs(run.peak / result.row.peak_bytes - 1) < 0.02
    frozen_gathers = [c for c in runs["zero3"].row.memory.collectives if "frozen" in c.what]
    assert len(frozen_gathers) == 2 and all(c.buffer_bytes > 0 for c in frozen_gathers)
    assert len(runs) == 4 and sum(len(r.runs) for r in runs.values()) >= 4


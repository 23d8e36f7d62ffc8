"""[Note: planner LoRA] without a process group: what `dataparallel plan --lora` says for a
Llama 3 8B on one H200 (issue 40, item 5), the adapters' count, FLOPs, and its refusals.
tests/dist/test_plan_lora.py holds the bytes against what each strategy holds."""

from __future__ import annotations

import pytest

import dataparallel as dp
from dataparallel.plan.errors import PlanError
from dataparallel.plan.llama import LLAMA_CONFIGS

ONE_H200 = {"ranks": 1, "hardware": "h200", "precision": "bf16-params", "seq_len": 2048}
LORA = "r=16,targets=q_proj,k_proj,v_proj,o_proj"


def adapters(r: int) -> int:
    """LoRA's parameters on llama-8b's q, k, v, o: r x (in + out) each, per block."""
    c = LLAMA_CONFIGS["llama-8b"]
    kv = c.head_dim * c.n_kv_heads
    per_block = r * ((c.dim + c.dim) + (c.dim + kv) * 2 + (c.dim + c.dim))
    return per_block * c.n_layer


def test_a_full_fine_tune_of_8b_does_not_fit_one_h200_and_lora_is_named():
    full = dp.plan("llama-8b", **ONE_H200)
    assert full.best is None and full.model.frozen == 0
    assert all(row.memory.model_state > 120e9 for row in full.rows)  # ~16 bytes a parameter
    assert "--lora r=16,targets=q_proj,v_proj" in full.reason


def test_lora_on_8b_fits_one_h200_and_counts_the_frozen_base():
    plan = dp.plan("llama-8b", lora=LORA, **ONE_H200)
    total = 8_030_261_248
    assert plan.model.params == adapters(16) == 13_631_488
    assert plan.model.frozen == total  # every base weight, adapters apart
    assert plan.best is not None and plan.best.candidate.label == "ddp"
    ddp = plan.best
    assert ddp.memory.frozen == 2 * total  # bf16, whole
    assert ddp.memory.params == 2 * (total + adapters(16))
    # the adapters alone train: their bf16 gradients, fp32 masters and 8-byte AdamW state
    assert ddp.memory.optimizer == 8 * adapters(16)
    assert ddp.memory.masters == 4 * adapters(16)
    assert 16e9 < ddp.held_bytes < 16.5e9 and ddp.peak_bytes < 141e9


def test_lora_flops_count_frozen_weights_at_four_and_adapters_at_six():
    full = dp.plan("gpt-small", ranks=1).model
    lora = dp.plan("gpt-small", ranks=1, lora="r=2,targets=q,v").model
    attention = 12 * full.layers * full.width * full.seq_len
    linear_full, linear_lora = full.flops_per_token - attention, lora.flops_per_token - attention
    assert lora.params == 2 * 2 * full.layers * (full.width + full.width)  # A and B on q and v
    assert linear_lora == linear_full * 4 // 6 + 6 * lora.params


def test_zero3_shards_the_frozen_base_and_gathers_it_with_its_units():
    plan = dp.plan("llama-8b", ranks=8, hardware="h200", precision="bf16-params", lora=LORA)
    rows = {r.candidate.label: r for r in plan.rows}
    ddp, zero3 = rows["ddp"], rows["zero3 S=8"]
    assert ddp.memory.frozen == 2 * 8_030_261_248
    assert ddp.memory.frozen / 8 <= zero3.memory.frozen < ddp.memory.frozen / 8 * 1.001
    assert zero3.memory.frozen_gathered > 0 and ddp.memory.frozen_gathered == 0


def test_bad_lora_specs_are_one_line_naming_the_flag():
    cases = {
        "r=0": "r >= 1",
        "r=8,targets=nope": "targets nope name no linear layer of llama-8b",
        "rank=8": "unknown key 'rank'",
    }
    for spec, said in cases.items():
        with pytest.raises(PlanError, match=said) as error:
            dp.plan("llama-8b", ranks=1, hardware="h200", lora=spec)
        assert str(error.value).startswith("--lora: ") and "\n" not in str(error.value)
    with pytest.raises(PlanError, match="^--lora: adapters are put on a built-in model only"):
        dp.plan(params=1e9, ranks=1, lora="r=4")
    with pytest.raises(PlanError, match="^--lora: LoRA under tensor parallelism"):
        dp.plan("llama-8b", ranks=2, tp=2, lora="r=4")
    assert len(cases) == 3


def test_what_is_not_planned_is_refused_in_one_line():
    refused = {
        ("gpt-small", "r=4,targets=q,v,head", None): "a target lies in ZeRO-3's root unit",
        ("gpt-small", "r=4,targets=q,dropout=0.1", None): "dropout=0.1 is not planned",
        ("llama-8b", "r=4", "zero-paper"): "the ZeRO paper's layout has no frozen parameters",
    }
    for (model, spec, layout), said in refused.items():
        with pytest.raises(PlanError, match=f"^--lora: {said}"):
            dp.plan(model, ranks=2, lora=spec, layout=layout or "dataparallel")
    assert len(refused) == 3
    # the head's adapters are planned where no candidate runs ZeRO-3
    head = dp.plan("gpt-small", ranks=2, lora="r=4,targets=q,v,head", strategies=["ddp", "zero2"])
    assert {r.candidate.strategy for r in head.rows} == {"ddp", "zero2"} and head.best is not None
    # an alias and its name adapt one layer once
    both = dp.plan("llama-8b", ranks=1, hardware="h200", lora="r=4,targets=gate_proj,w1")
    assert both.model.params == 4 * (4096 + 14336) * 32

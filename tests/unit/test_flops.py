"""MFU's FLOP count (plan/flops.py) against torchtitan's published figures for Llama 3 8B, and
what the planner says fits on one H200 (issue 40)."""

from __future__ import annotations

import pytest
import torch

import dataparallel as dp
from dataparallel.plan.flops import flops_per_token, mfu, module_flops_per_token, peak_flops
from dataparallel.plan.llama import LLAMA_CONFIGS, Llama
from dataparallel.plan.model import builtin_shape

# Llama 3 8B (Meta's config): 32 layers, width 4096, vocabulary 128256, SwiGLU 14336, 8 KV
# heads, untied head. Its parameters by hand: the embedding and the head 2 x 128256 x 4096;
# per layer q and o 4096^2 each, k and v 4096 x 1024 each, three MLP matrices 4096 x 14336,
# two norms of 4096; one final norm.
EMBEDDING = 128256 * 4096
PER_LAYER = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
PARAMS = 2 * EMBEDDING + 32 * PER_LAYER + 4096
# 6 x (8,030,261,248 - 525,336,576) + 12 x 32 x 4096 x 8192 = 45,029,548,032 + 12,884,901,888
FLOPS_8B = 57_914_449_920


def test_llama3_8b_flops_per_token_is_torchtitans_57_9_gflop_at_sequence_8192():
    assert PARAMS == 8_030_261_248  # Meta's published 8.03B
    assert flops_per_token(PARAMS, EMBEDDING, 32, 4096, 8192) == FLOPS_8B
    assert abs(FLOPS_8B / 57.9e9 - 1) < 1e-3  # torchtitan's ~57.9 GFLOP, to 0.1%
    with torch.device("meta"):  # the same from the module, on meta: nothing allocated
        model = Llama(LLAMA_CONFIGS["llama-8b"])
    assert module_flops_per_token(model, 32, 4096, 8192) == FLOPS_8B
    # The planner's count (linear weights: the norms left out) agrees to 0.003%.
    planned = builtin_shape("llama-8b", 8192, torch.bfloat16, None).flops_per_token
    assert planned == FLOPS_8B - 6 * (65 * 4096)
    assert abs(planned / FLOPS_8B - 1) < 3e-5


def test_mfu_of_torchtitans_compiled_8b_run_is_its_39_percent():
    # torchtitan: Llama 3 8B, 8 H100s, compile: 6,667 tokens/s per GPU, 39% MFU.
    assert mfu(6667, FLOPS_8B, 989e12) == pytest.approx(0.3904, abs=1e-4)
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("cpu") is None


def test_a_tied_head_is_counted_once_as_the_embedding():
    with torch.device("meta"):
        model = Llama(LLAMA_CONFIGS["llama-1b"])  # Llama 3.2 1B ties its head
    params = sum(p.numel() for p in model.parameters())
    assert params == 1_235_814_400
    expected = 6 * (params - 128256 * 2048) + 12 * 16 * 2048 * 2048
    assert module_flops_per_token(model, 16, 2048, 2048) == expected == 6_644_183_040


def test_llama_8b_on_one_h200_full_adamw_does_not_fit_at_8192():
    plan = dp.plan("llama-8b", ranks=1, hardware="h200", precision="bf16-params")
    assert plan.hardware.memory_bytes == 141e9
    assert plan.best is None and len(plan.rows) == 4  # ddp, zero1/2/3 on S = 1
    # 16 bytes per parameter at the least (ZeRO-3: fp32 masters, gradients and two moments)
    least = min(r.held_bytes for r in plan.rows)
    assert least == pytest.approx(16 * PARAMS, rel=1e-3)
    assert least > 128e9

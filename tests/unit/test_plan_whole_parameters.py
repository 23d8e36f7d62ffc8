"""`dp.plan(..., optimizer="muon"|"adafactor")` ([Note: the planned optimizers] in
plan/whole_parameters.py) against hand numbers on a five-tensor model: an embedding 10 x 4,
two hidden matrices 8 x 4 and 4 x 8, a norm (4 + 4) and a head 4 -> 10; 152 parameters,
vocabulary 10, 16 tokens per sample, micro-batch 2, 4 ranks in fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.plan.render import as_json, as_table


def _plan(optimizer: str):
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Embedding(10, 4),
            nn.Linear(4, 8, bias=False),
            nn.Linear(8, 4, bias=False),
            nn.LayerNorm(4),
            nn.Linear(4, 10, bias=False),
        )
    return dp.plan(model, seq_len=16, vocab=10, ranks=4, optimizer=optimizer, micro_batch=2)


def _optim_column(plan) -> dict[str, float]:
    return {r.candidate.label: r.memory.optimizer for r in plan.rows}


def test_muon_owns_the_hidden_matrices_and_shards_adamws_rest():
    plan = _plan("muon")
    whole = plan.whole
    # Muon's momentum, 4 bytes x 32 per hidden matrix; AdamW's 8 bytes x the other 88.
    assert whole.owned == (128.0, 128.0) and whole.flat_bytes == 704.0
    assert whole.state_bytes_per_param == pytest.approx(960 / 152)
    columns = _optim_column(plan)
    assert columns["ddp"] == pytest.approx(960) and columns["zero3 S=4"] == pytest.approx(240)
    busiest, even, owners = whole.per_rank(2)  # one matrix each: balanced
    assert (busiest, even, owners.idle) == (480.0, 480.0, 0)
    busiest, even, owners = whole.per_rank(4)  # two owners of four, 128 + 704 / 4 on them
    assert (busiest, even, owners.idle) == (304.0, 240.0, 2)
    # Newton-Schulz on 8 x 4: 5 (4 x 16 x 8 + 2 x 64) = 3200 FLOPs; forward and backward:
    # 6 x 104 linear weights = 624 FLOPs/token x 128 tokens / 4 ranks = 19968 per rank.
    muon = whole.muon
    assert (muon.newton_schulz, muon.busiest, muon.forward_backward) == (6400, 3200, 19968)
    assert muon.distributed_share == pytest.approx(3200 / 19968)
    assert muon.verdict().endswith("it does not dominate")
    table = as_table(plan)
    assert (
        "zero3 S=4: busiest owner 3.04e-07 GB of optimizer state, even split 2.4e-07 GB " in table
    )
    assert "(imbalance 1.27x, 2 of 4 ranks own nothing)" in table
    assert as_json(plan).count('"busiest_bytes"') == 6  # zero1/2/3 at S = 2 and 4


def test_adafactor_owns_every_parameter_with_factored_moments():
    whole = _plan("adafactor").whole
    # 4 (rows + cols) per matrix: 56, 48, 48, 56; 4 bytes per element of the norm's two.
    assert sorted(whole.owned) == [16.0, 16.0, 48.0, 48.0, 56.0, 56.0]
    assert whole.flat_bytes == 0.0 and whole.muon is None
    assert whole.per_rank(2)[:2] == (120.0, 120.0)
    assert whole.per_rank(4)[:2] == (64.0, 60.0)  # 56 | 56 | 48 + 16 | 48 + 16


def test_muon_dominates_below_five_d_tokens_per_step():
    plan = dp.plan("gpt-small", ranks=2, optimizer="muon")
    assert plan.whole.muon.verdict().endswith("dominates the step (distributed and DDP)")
    assert dp.plan("gpt-small", ranks=2).whole is None  # adamw: flat shards, no owners

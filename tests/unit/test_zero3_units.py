"""ZeRO-3's grouped units as pure logic: the grouping rule and the plans it makes ([Note:
grouped units] in strategies/zero3/plan.py), no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.models import GPT, GPTConfig
from dataparallel.strategies.zero3.group import GroupedUnits
from dataparallel.strategies.zero3.plan import (
    MIN_UNIT_PARAMS,
    group_consecutive,
    param_shapes,
    plan_units,
)

# (sizes, min_params) -> the groups, as lists of positions
CASES = {
    ((5, 5, 5, 5), 0): [[0], [1], [2], [3]],  # 0: every unit alone
    ((5, 5, 5, 5), 5): [[0], [1], [2], [3]],  # each already holds 5
    ((5, 5, 5, 5), 10): [[0, 1], [2, 3]],
    ((5, 5, 5, 5, 5), 10): [[0, 1], [2, 3], [4]],  # the remainder stays small
    ((5, 5, 5, 5), 11): [[0, 1, 2], [3]],  # merged until at least 11
    ((5, 20, 5, 5), 10): [[0], [1], [2, 3]],  # a unit bigger than the threshold stays alone
    ((20, 5, 5), 10): [[0], [1, 2]],
    ((5, 5, 5), 10**9): [[0, 1, 2]],
    ((0, 0, 5), 1): [[0, 1], [2]],  # units owning nothing merge; 5 >= 1 stays alone
    ((), 10): [],
}


def test_group_consecutive():
    assert len(CASES) == 10
    for (sizes, min_params), expected in CASES.items():
        got = [list(r) for r in group_consecutive(list(sizes), min_params)]
        assert got == expected, (sizes, min_params, got)


def gpt(n_layer=5, tie=True):
    # blocks of 3,264 parameters (width 16, biases), the root 672 with the tied head
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16,
                         tie_weights=tie))  # fmt: skip


def test_plans_of_grouped_blocks():
    model = gpt()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    cases = {
        0: ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"],
        block: ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"],
        block + 1: ["", "blocks.0-1", "blocks.2-3", "blocks.4"],
        2 * block + 1: ["", "blocks.0-2", "blocks.3-4"],
        10**9: ["", "blocks.0-4"],
    }
    for min_unit_params, names in cases.items():
        plans = plan_units(model, None, min_unit_params)
        assert [p.name for p in plans] == names, (min_unit_params, plans)
        assert all(p.parent == 0 for p in plans[1:])
        # every parameter once; the tied embedding in the root
        assert sum(p.numel() for plan in plans for p in plan.params) == model.num_parameters()
        assert any(p is model.tok_emb.weight for p in plans[0].params)
    plans = plan_units(model, None, block + 1)
    assert (
        plans[1].modules == (model.blocks[0], model.blocks[1])
        and plans[1].module is model.blocks[0]
    )
    assert plans[1].member_names == ("blocks.0", "blocks.1")
    assert [p for p in plans[1].params] == [
        *model.blocks[0].parameters(),
        *model.blocks[1].parameters(),
    ]
    assert len(cases) == 5


def test_grouping_follows_wrap_and_siblings():
    model = gpt(n_layer=4)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    # wrap selects blocks 0, 1 and 3: 2 is not a unit, so 1 and 3 are not consecutive
    chosen = (model.blocks[0], model.blocks[1], model.blocks[3])
    plans = plan_units(model, lambda m: any(m is c for c in chosen), 10**9)
    assert [p.name for p in plans] == ["", "blocks.0-1", "blocks.3"]
    assert sum(p.numel() for p in plans[0].params) == 672 + block  # block 2 in the root
    # units that are not in a ModuleList stay alone (the embeddings, each Linear)
    plans = plan_units(model, (nn.Linear,), 10**9)
    assert all("-" not in p.name for p in plans) and len(plans) == 1 + 4 * 6


class Expert(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.fc(x)


class Nested(nn.Module):
    """A ModuleList of layers, each holding a ModuleList of experts; layer 1's first expert
    shares its weight with layer 0's last expert; layer 2 is large."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()
        for width in (4, 4, 12, 4):
            layer = nn.Module()
            layer.experts = nn.ModuleList(Expert(width) for _ in range(3))
            self.layers.append(layer)
        self.layers[1].experts[0].fc.weight = self.layers[0].experts[2].fc.weight

    def forward(self, x):
        return x


def test_nested_and_tied_groups():
    model = Nested()
    plans = plan_units(model, None, 40)
    # the layers own no parameter of their own (their experts are units): all four merge into
    # one unit, which then owns the weight tied between two of its experts' units (their
    # nearest common unit); layer 2's experts hold 144 >= 40 each and stay alone
    assert [p.name for p in plans] == [
        "",
        "layers.0-3",
        "layers.0.experts.0-2",
        "layers.1.experts.0-2",
        "layers.2.experts.0",
        "layers.2.experts.1",
        "layers.2.experts.2",
        "layers.3.experts.0-2",
    ]
    assert [p.parent for p in plans] == [None, 0, 1, 1, 1, 1, 1, 1]
    tied = model.layers[0].experts[2].fc.weight
    assert list(plans[1].params) == [tied]  # one weight tied: counted once below
    assert [p.numel() for p in plans[2].params] == [16, 16]  # experts 0 and 1 of layer 0
    assert sum(p.numel() for plan in plans for p in plan.params) == 8 * 16 + 3 * 144


def test_a_frozen_part_splits_a_grouped_unit():
    model = gpt(n_layer=2)
    model.blocks[1].attn.requires_grad_(False)
    plans = plan_units(model, None, 10**9)
    assert [p.name for p in plans] == ["", "blocks.0-1[frozen]", "blocks.0-1"]
    assert plans[1].modules == plans[2].modules == (model.blocks[0], model.blocks[1])
    assert all(not p.requires_grad for p in plans[1].params)


def test_param_shapes_carry_the_grouped_units():
    model = gpt(tie=False)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    shapes = param_shapes(model, None, block + 1)
    assert [sum(u) for u in shapes.units[1:]] == [2 * block, 2 * block, block]
    assert sum(map(sum, shapes.units)) == sum(shapes.numels) == model.num_parameters()
    assert len(param_shapes(model, None, 0).units) == 6


def test_open_groups_must_enclose_the_unit_that_starts():
    grouped = GroupedUnits([None, 0, 1, 0])  # unit 1 grouped, unit 2 nested in it, unit 3 not
    run = grouped.add("blocks.0-1", ("blocks.0", "blocks.1"), 1)
    assert run.enter(0) and not run.leave(0)
    grouped.open.append(run)
    grouped.opening(2, "blocks.0.inner")  # nested: fine
    with pytest.raises(RuntimeError, match="ran 'blocks.0' but not 'blocks.1' before unit 'x'"):
        grouped.opening(3, "x")
    with pytest.raises(RuntimeError, match="ran 'blocks.0' but not 'blocks.1' before the end"):
        grouped.ending()
    grouped.opening(0, "<root>")  # a new forward: nothing open
    assert grouped.open == [] and not run.open


def test_the_default_groups_only_blocks_under_400k_parameters():
    from dataparallel.models import build_model

    names = {}
    for model_name in ("gpt-small", "gpt-tiny"):
        with torch.device("meta"):
            model = build_model(model_name)
        names[model_name] = [p.name for p in plan_units(model, None, MIN_UNIT_PARAMS)]
        assert names[model_name][0] == ""
    # gpt-small's blocks (789,760 parameters) stay one unit each: its step and memory as before
    assert names["gpt-small"][1:] == [f"blocks.{i}" for i in range(4)]
    assert names["gpt-tiny"][1:] == ["blocks.0-1", "blocks.2-3"]  # 250,704 each
    assert MIN_UNIT_PARAMS == 400_000 and dp.ZeRO3().min_unit_params == MIN_UNIT_PARAMS

"""DiLoCo's outer settings chosen for the run ([Note: the outer learning rate] in
averaging/outer_settings.py): every measured cell for itself, runs off the table, a user's
values over the table's, and the inner optimizer's row; pure logic, no process group."""

from __future__ import annotations

import json

import pytest
import torch

import dataparallel as dp
from dataparallel.averaging import CHOSEN, choose_outer
from dataparallel.averaging.outer_settings import MEASURED, nearest_cell
from dataparallel.compose import inner_optimizer


def test_every_measured_cell_is_chosen_for_its_own_run():
    assert len(MEASURED) >= 4
    for (kind, replicas, every), (lr, momentum) in MEASURED.items():
        chosen = choose_outer(replicas, every, kind.split()[0], streamed="streamed" in kind)
        assert (chosen.lr, chosen.momentum) == (lr, momentum)
        assert f"{replicas} replica" in chosen.source and f"H = {every}" in chosen.source


@pytest.mark.parametrize(
    ("replicas", "every", "inner", "cell"),
    [
        (2, 25, "adamw", ("adamw", 2, 30)),  # the nearest H
        (2, 15, "adamw", ("adamw", 2, 10)),  # on a log scale 15 is nearer 10 than 30
        (2, 60, "adamw", ("adamw", 2, 100)),
        (2, 1000, "adamw", ("adamw", 2, 100)),
        (3, 30, "adamw", ("adamw", 4, 30)),  # on a log scale 3 is nearer 4 than 2
        (6, 30, "adamw", ("adamw", 4, 30)),
        (64, 500, "adamw", ("adamw", 4, 30)),  # beyond the table: its edge
        (2, 30, "muon", ("muon", 2, 30)),
        (8, 30, "sgd", ("adamw", 4, 30)),  # another inner optimizer takes AdamW's rows
    ],
)
def test_a_run_off_the_table_takes_its_nearest_cell(replicas, every, inner, cell):
    assert nearest_cell(replicas, every, inner if inner in ("adamw", "muon") else "adamw") == cell
    chosen = choose_outer(replicas, every, inner)
    assert (chosen.lr, chosen.momentum) == MEASURED[cell]


def test_streaming_has_its_own_cells_else_its_optimizers_plain_ones():
    streamed = choose_outer(2, 30, "adamw", streamed=True)
    assert (streamed.lr, streamed.momentum) == MEASURED[("adamw streamed", 2, 30)]
    assert streamed.momentum != choose_outer(2, 30, "adamw").momentum  # measured apart
    muon = choose_outer(2, 30, "muon", streamed=True)  # no streamed Muon cell: Muon's own
    assert (muon.lr, muon.momentum) == MEASURED[("muon", 2, 30)]
    assert dp.Recipe(diloco=30).outer(2) == streamed  # the recipe streams (2 fragments)
    plain = dp.Recipe(diloco=30, fragments=1, overlap=0).outer(2)
    assert (plain.lr, plain.momentum) == MEASURED[("adamw", 2, 30)]


def test_given_values_win_over_the_table():
    given = choose_outer(2, 30, "adamw", lr=0.3, momentum=0.5)
    assert (given.lr, given.momentum, given.source) == (0.3, 0.5, "given")
    half = choose_outer(2, 30, "muon", lr=0.3)
    assert (half.lr, half.momentum) == (0.3, MEASURED[("muon", 2, 30)][1])
    assert half.source.startswith("lr given, the rest the table's for 2 replicas")
    recipe = dp.Recipe(diloco=30, fragments=1, overlap=0, outer_momentum=0.0)
    assert recipe.outer(2).momentum == 0.0 and recipe.outer(2).lr == MEASURED[("adamw", 2, 30)][0]
    assert dp.Recipe(diloco=30).outer_lr == CHOSEN


def test_compose_reads_muon_from_the_class_or_a_group():
    assert inner_optimizer(torch.optim.AdamW) == "adamw"
    assert inner_optimizer(torch.optim.Muon) == "muon"
    groups = [{"params": []}, {"params": [], "optimizer": torch.optim.Muon}]
    assert inner_optimizer(torch.optim.AdamW, groups) == "muon"
    assert inner_optimizer(torch.optim.SGD, [torch.zeros(1)]) == "adamw"


def test_the_planner_prints_what_the_job_will_use():
    from dataparallel.plan.api import plan
    from dataparallel.plan.render import as_json, as_table

    chosen = plan("gpt-small", ranks=4, strategies=["diloco"], diloco_steps=30)
    expected = dp.Recipe(diloco=30).outer(4)  # the recipe streams: its own cells
    assert expected.source.endswith("under AdamW, streamed")
    assert f"diloco S=1: {expected.describe()}" in as_table(chosen)
    muon = plan("gpt-small", ranks=2, strategies=["diloco"], optimizer="muon", diloco_steps=30)
    assert choose_outer(2, 30, "muon").describe() in as_table(muon)
    given = plan(
        "gpt-small",
        ranks=4,
        strategies=["diloco"],
        recipe=dp.Recipe(diloco=30, outer_lr=0.25, outer_momentum=0.5),
    )
    assert json.loads(as_json(given))["outer"] == {
        "diloco S=1": {"lr": 0.25, "momentum": 0.5, "source": "given"}
    }

"""`dp.Layout`: the parallel layout validated once, and every rank's answers by purpose
([Note: layout] in strategies/parts/parallel_layout.py). Pure arithmetic: no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

import dataparallel as dp
from dataparallel.plan import PlanError, PlanInputs
from dataparallel.train.config import ConfigError, RunConfig

# (fields, the one-line error): each names the field and how to fix it
BAD = [
    ({"world": 0}, "Layout.world: 0 is below 1; use 1+"),
    ({"world": 4.0}, "Layout.world: 4.0 is not an integer; give an integer >= 1"),
    ({"world": 4, "tp": 0}, "Layout.tp: 0 is below 1; use 1 (no tensor parallelism) or more"),
    ({"world": 4, "tp": True}, "Layout.tp: True is not an integer; give an integer >= 1"),
    ({"world": 6, "tp": 4}, "Layout.tp: 4 does not divide the 6 ranks; use a divisor of them"),
    ({"world": 4, "shard_size": -1}, "Layout.shard_size: -1 is below 0; use 0+"),
    (
        {"world": 8, "tp": 2, "shard_size": 3},
        "Layout.shard_size: 3 does not divide the 4 ranks; use a divisor, or 0 for none",
    ),
]


@pytest.mark.parametrize("fields, message", BAD)
def test_a_layout_that_does_not_fit_names_its_field_on_one_line(fields, message):
    with pytest.raises(dp.LayoutError) as caught:
        dp.Layout(**fields)
    assert str(caught.value) == message
    assert "\n" not in message and caught.value.field == message.split(":")[0][len("Layout.") :]


def test_the_error_cases_are_all_counted():
    assert len(BAD) == 7


R = range(8)
# (layout, degrees (data_size, shard, replicas, saved_replicas, hsdp), per rank 0..7: data
# rank, counts the loss, replica, saved replica), then rank 5's groups (tp, shard, replicate)
CASES = {
    "1-D ZeRO over 8": (
        dp.Layout(8),
        (8, 8, 1, 1, False),
        (list(R), [True] * 8, [0] * 8, [0] * 8),
        ([5], list(R), [5]),
    ),
    "DDP over 8": (
        dp.Layout(8, sharded=False),
        (8, 1, 8, 1, False),
        (list(R), [True] * 8, list(R), [0] * 8),
        ([5], [5], list(R)),
    ),
    "HSDP 4 x 2": (
        dp.Layout(8, shard_size=2),
        (8, 2, 4, 1, True),
        (list(R), [True] * 8, [0, 0, 1, 1, 2, 2, 3, 3], [0] * 8),
        ([5], [4, 5], [1, 3, 5, 7]),
    ),
    "TP 2 x ZeRO over 4": (
        dp.Layout(8, tp=2),
        (4, 4, 1, 1, False),
        ([0, 0, 1, 1, 2, 2, 3, 3], [True, False] * 4, [0] * 8, [0] * 8),
        ([4, 5], [1, 3, 5, 7], [5]),
    ),
    "TP 2 x HSDP 2 x 2": (
        dp.Layout(8, tp=2, shard_size=2),
        (4, 2, 2, 1, True),
        ([0, 0, 1, 1, 2, 2, 3, 3], [True, False] * 4, [0, 0, 0, 0, 1, 1, 1, 1], [0] * 8),
        ([4, 5], [5, 7], [1, 5]),
    ),
    "averaged replicas of 2": (
        dp.Layout(8, shard_size=2, averaged=True),
        (8, 2, 4, 4, False),
        (list(R), [True] * 8, [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 1, 1, 2, 2, 3, 3]),
        ([5], [4, 5], [1, 3, 5, 7]),
    ),
    "averaged single ranks under TP 2": (
        dp.Layout(8, tp=2, averaged=True),
        (4, 1, 4, 4, False),
        ([0, 0, 1, 1, 2, 2, 3, 3], [True, False] * 4, [0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 1, 1, 2, 2, 3, 3]),
        ([4, 5], [5], [1, 3, 5, 7]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_each_rank_is_answered_by_purpose(name):
    layout, degrees, per_rank, groups = CASES[name]
    got = (layout.data_size, layout.shard, layout.replicas, layout.saved_replicas, layout.hsdp)
    assert got == degrees
    assert [layout.data_rank(r) for r in R] == per_rank[0]  # data loading
    assert [layout.counts_loss(r) for r in R] == per_rank[1]  # the loss
    assert [layout.replica_of(r) for r in R] == per_rank[2]
    assert [layout.saved_replica_of(r) for r in R] == per_rank[3]  # the checkpoints
    assert (layout.tp_ranks(5), layout.shard_ranks(5), layout.replicate_ranks(5)) == groups
    # every rank lies in one shard group and one replicate group, which meet in it alone
    for r in R:
        assert set(layout.shard_ranks(r)) & set(layout.replicate_ranks(r)) == {r}
        assert r in layout.data_ranks(r) and len(layout.shard_ranks(r)) == layout.shard


def test_the_replica_cases_are_all_counted():
    assert len(CASES) == 7


def test_a_rank_outside_the_world_is_refused_and_a_live_world_resizes():
    with pytest.raises(dp.LayoutError, match=r"^Layout.world: rank 8 is outside 0..7"):
        dp.Layout(8).replica_of(8)
    grown = dp.Layout(4, shard_size=2, averaged=True).resized(6)
    assert (grown.world, grown.replicas, grown.replica_of(5)) == (6, 3, 2)


def test_each_front_end_names_its_own_field():
    """The recipe, the job and the planner build the one Layout and spell its errors."""
    with pytest.raises(dp.RecipeError, match=r"^Recipe.shard_size: 3 does not divide the 4 r"):
        dp.Recipe(strategy="zero3", shard_size=3).layout(4)
    assert dp.Recipe(strategy="ddp", local_sgd=4).layout(4) == dp.Layout(
        4, sharded=False, averaged=True
    )
    config = RunConfig().replace(launch={"nproc": 3, "tp": 2})
    with pytest.raises(ConfigError, match=r"^--tp \(launch.tp\): 2 does not divide the 3 ranks"):
        config.layout  # noqa: B018
    with pytest.raises(PlanError, match=r"^--shard-size: 4 does not divide the 6 ranks"):
        PlanInputs(ranks=6, shard_sizes=(4,))
    two = PlanInputs(ranks=8, recipe=dp.Recipe(tp=2, diloco=100))
    assert two.parallel_layout(2, "diloco").saved_replicas == 2


def test_the_derivations_it_replaced_are_gone():
    """One home: no other module defines the data ranks, the replica of a rank or the split."""
    src = Path(dp.__file__).parent
    names = (
        "class DataRanks",
        "def replica_of(state",
        "def data_ranks(self) -> int",
        "def split_for_run",
    )
    found = [
        f"{path.relative_to(src)}: {name}"
        for path in sorted(src.rglob("*.py"))
        for name in names
        if name in path.read_text()
    ]
    assert found == []

"""One recipe vocabulary: a field, its default and its rule written once (`dp.Recipe`), and
every front end (the job's config, the planner) mapping to it ([Note: one home for the recipe's
rules] in dataparallel/recipe.py)."""

from __future__ import annotations

from dataclasses import fields

import pytest

import dataparallel as dp
from dataparallel.plan import PlanError, PlanInputs
from dataparallel.plan import inputs as plan_inputs
from dataparallel.strategies import PRECISIONS
from dataparallel.train.config import SyncConfig, TrainConfig

# name -> (param bytes, gradient bytes, fp32 masters, autocast): what the planner counts
BYTES = {
    "fp32": (4, 4, False, False),
    "bf16": (4, 4, False, True),
    "bf16-params": (2, 2, True, False),
    "fp16": (2, 2, True, False),
}


def test_the_engine_and_the_planner_read_one_precision_table():
    assert dp.PRECISIONS is PRECISIONS is plan_inputs.PRECISIONS
    assert len(BYTES) == 4 and list(PRECISIONS) == list(BYTES)
    for name, expected in BYTES.items():
        x = PlanInputs(ranks=2, recipe=dp.Recipe(precision=name, diloco=100))
        assert x.numbers is PRECISIONS[name]
        assert (x.param_bytes, x.grad_bytes, x.masters, x.autocast) == expected
        recipe = dp.Recipe(precision=name)  # the engine's reading of the same entry
        assert recipe.policy().precision == (PRECISIONS[name].policy or dp.MixedPrecision())
        assert (recipe.autocast_dtype is not None) == expected[3]
    assert [n for n, p in PRECISIONS.items() if p.scaling] == ["fp16"]


def test_the_sync_section_is_recipe_fields_with_the_recipes_defaults():
    recipe = {f.name: f for f in fields(dp.Recipe)}
    job_only: set[str] = set()  # [sync] has no field of its own
    sync = {f.name: f for f in fields(SyncConfig)}
    assert set(sync) - set(recipe) == job_only
    assert len(sync) == 10
    for name, f in sync.items():
        assert (f.type, f.default) == (recipe[name].type, recipe[name].default), name
    assert TrainConfig().precision == dp.Recipe().precision
    assert TrainConfig().activation_checkpointing == dp.Recipe().activation_checkpointing


def test_the_planners_candidates_are_the_engines_strategies_and_diloco():
    assert plan_inputs.STRATEGIES == (*dp.STRATEGIES, "diloco")
    assert set(plan_inputs.COMPRESSORS) == {"none", *dp.compression.COMPRESSORS, "bf16"}


# (plan arguments, the flag its error names): the recipe's rule, spelled as the planner's flag
PLAN_ERRORS = [
    ({"precision": "fp8"}, "--precision: 'fp8' is unknown"),
    ({"fragments": 3}, "--fragments: fragments=3 must divide every=100"),
    ({"outer_compress": "int2"}, "--outer-compress: 'int2' is unknown"),
    ({"diloco_steps": 0}, "--diloco-steps: must be a positive integer, got 0"),
    ({"tp": 3}, "--tp: 3 does not divide the 4 ranks"),
]


@pytest.mark.parametrize("given, message", PLAN_ERRORS)
def test_the_planner_raises_the_recipes_rule_under_its_flag(given, message):
    with pytest.raises(PlanError) as caught:
        dp.plan(params=1e6, ranks=4, **given)
    assert str(caught.value).startswith(message)
    assert len(PLAN_ERRORS) == 5


def test_the_planner_takes_a_recipe():
    """A Recipe in place of its fields gives the same plan."""
    by_fields = dp.plan("gpt-tiny", ranks=4, precision="bf16-params", compress="int8", tp=2)
    recipe = dp.Recipe(precision="bf16-params", compress="int8", tp=2)
    by_recipe = dp.plan("gpt-tiny", ranks=4, recipe=recipe)
    assert [r.candidate.label for r in by_recipe.rows] == [
        r.candidate.label for r in by_fields.rows
    ]
    assert [r.peak_bytes for r in by_recipe.rows] == [r.peak_bytes for r in by_fields.rows]

"""DataParallelStrategy's arguments: each bad one is refused in one line naming it, at
construction, before any process group or model exists (real `lightning`, no world)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402

import dataparallel as dp  # noqa: E402
from dataparallel.lightning import DataParallelStrategy  # noqa: E402
from dataparallel.lightning.precision import recipe_precision  # noqa: E402

BAD = [
    ({"strategy": "zero4"}, dp.RecipeError, "strategy"),
    ({"precision": "fp8"}, dp.RecipeError, "precision"),
    ({"recovery": "live"}, ValueError, "recovery='live'"),
    ({"diloco": -1}, dp.RecipeError, "diloco"),
    ({"bucket_mb": 4}, TypeError, "unknown argument 'bucket_mb'"),
]


@pytest.mark.parametrize("kwargs,error,named", BAD)
def test_a_bad_argument_is_one_line_naming_it(kwargs, error, named):
    with pytest.raises(error) as caught:
        DataParallelStrategy(**kwargs)
    message = str(caught.value)
    assert named in message and "\n" not in message


def test_the_registered_names_build_each_strategy():
    from lightning.pytorch.strategies import StrategyRegistry

    names = [n for n in StrategyRegistry.available_strategies() if n.startswith("dataparallel_")]
    assert sorted(names) == sorted(f"dataparallel_{s}" for s in dp.STRATEGIES)
    for name in names:
        built = StrategyRegistry.get(name)
        assert isinstance(built, DataParallelStrategy)
        assert built.recipe.strategy == name.removeprefix("dataparallel_")


def test_the_precision_is_given_once():
    cases = [
        (Precision(), None, "fp32"),
        (MixedPrecision("bf16-mixed", "cpu"), None, "bf16"),
        (Precision(), "bf16-params", "bf16-params"),
        (Precision(), "fp16", "fp16"),
    ]
    for plugin, given, expected in cases:
        assert recipe_precision(plugin, given) == expected
    with pytest.raises(ValueError, match="given twice") as twice:
        recipe_precision(MixedPrecision("bf16-mixed", "cpu"), "bf16-params")
    with pytest.raises(ValueError, match="no counterpart") as other:
        recipe_precision(MixedPrecision("16-mixed", "cpu"), None)
    assert "\n" not in str(twice.value) + str(other.value)
    assert len(cases) == 4

"""`dp.Recipe` refuses what cannot compose, with the field and the fix ([Note: composition])."""

import pytest

import dataparallel as dp


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"strategy": "zero4"}, "Recipe.strategy: 'zero4' is unknown"),
        ({"precision": "fp8"}, "Recipe.precision: 'fp8' is unknown"),
        ({"local_sgd": 2, "diloco": 2}, "Recipe.diloco: local SGD and DiLoCo are both"),
        ({"compress": "int8", "diloco": 4}, "Recipe.compress: gradients are reduced only"),
        ({"outer_compress": "int8"}, "Recipe.outer_compress: only DiLoCo has outer"),
        ({"shard_size": -1}, "Recipe.shard_size: -1 is negative"),
        ({"diloco": 4, "outer_lr": 0}, "Recipe.outer_lr: 0 is not positive"),
        ({"diloco": 4, "outer_momentum": 1.0}, r"Recipe.outer_momentum: 1.0 is outside \[0, 1\)"),
    ],
)
def test_recipe_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        dp.Recipe(**fields)

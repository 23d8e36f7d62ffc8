"""`dp.Recipe` refuses what cannot compose, with the field and the fix ([Note: composition])."""

import pytest

import dataparallel as dp
from dataparallel.averaging import Streaming


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


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"diloco": 20, "fragments": 3}, "Recipe.fragments: fragments=3 must divide every=20"),
        ({"diloco": 20, "overlap": 5}, "Recipe.overlap: overlap=5 must be below every / frag"),
        ({"fragments": 2}, "Recipe.fragments: only DiLoCo streams fragments"),
        ({"outer_warmup": 8}, "Recipe.outer_warmup: only DiLoCo streams fragments"),
        ({"diloco": 20, "outer_warmup": -2}, "Recipe.outer_warmup: -2 is negative"),
        ({"diloco": 20, "outer_compress": "int2"}, "Recipe.outer_compress: 'int2' is unknown"),
        ({"diloco": 20, "lr_warmup": -1}, "Recipe.lr_warmup: -1 is not an integer >= 0"),
        ({"diloco": 20, "run_steps": -1}, "Recipe.run_steps: -1 is not an integer >= 0"),
    ],
)
def test_streaming_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        dp.Recipe(**fields)


def test_diloco_h_streams_as_the_recipe_says_and_the_paper_stays_reachable():
    """[Note: the DiLoCo recipe]: 4 fragments (else 2, else 1, with 2 steps between them),
    overlap 1 where there is room, int4 outer gradients, a warm-up as long as the learning
    rate's (30 steps unless lr_warmup says)."""
    got = {h: dp.Recipe(diloco=h).streaming for h in (1, 2, 4, 10, 20, 50)}
    assert {h: (s.fragments, s.overlap) for h, s in got.items()} == {
        1: (1, 0), 2: (1, 1), 4: (2, 1), 10: (2, 1), 20: (4, 1), 50: (2, 1),
    }  # fmt: skip
    assert {(s.compress, s.warmup) for s in got.values()} == {("int4", 30)}
    plain = dp.Recipe(diloco=20, fragments=1, overlap=0, outer_warmup=0, outer_compress="fp32")
    assert plain.streaming == Streaming(fragments=1, overlap=0, compress=None, warmup=0)
    # each field given keeps its value, the others still the recipe's for that H
    assert dp.Recipe(diloco=20, fragments=2).streaming == Streaming(
        fragments=2, overlap=1, compress="int4", warmup=30
    )
    assert dp.Recipe(diloco=20, outer_compress="").streaming.compress is None  # fp32, as before
    assert dp.Recipe(diloco=20, lr_warmup=50).streaming.warmup == 50
    # a long run warms up for a tenth of it (gpt-small, 2,000 steps: +3.1% against +4.5%)
    assert dp.Recipe(diloco=20, run_steps=2000).streaming.warmup == 200
    assert dp.Recipe(diloco=20, run_steps=300).streaming.warmup == 30  # the LR's is longer
    assert dp.Recipe(diloco=20, run_steps=2000, outer_warmup=5).streaming.warmup == 5
    # an old config's "off" values stay accepted without DiLoCo
    dp.Recipe(fragments=1, overlap=0, outer_warmup=0, outer_compress="")


# One bad value per [sync] field ([Note: one home for the recipe's rules]): the error names it.
SYNC_CASES = {
    "compress": {"compress": "zip"},
    "local_sgd": {"local_sgd": -1},
    "diloco": {"diloco": -1},
    "outer_lr": {"outer_lr": 0},
    "outer_momentum": {"outer_momentum": 1.0},
    "outer_compress": {"outer_compress": "int2"},
    "fragments": {"fragments": 2},
    "overlap": {"overlap": 1},
    "mix": {"diloco": 4, "mix": 2.0},
    "outer_warmup": {"diloco": 4, "outer_warmup": -2},
}


def test_every_sync_field_has_a_case():
    from dataclasses import fields

    from dataparallel.train.config import SyncConfig

    assert sorted(SYNC_CASES) == sorted(f.name for f in fields(SyncConfig))
    assert len(SYNC_CASES) == 10


@pytest.mark.parametrize("name", sorted(SYNC_CASES))
def test_a_sync_field_names_itself_in_the_recipe_and_as_its_flag(name):
    """dp.Recipe raises a RecipeError whose field is the one at fault; the CLI spells it as
    the flag and the TOML key, with the fix's field names as flags too."""
    from dataparallel.train.config import ConfigError, RunConfig
    from dataparallel.train.sync import check_run_recipe

    with pytest.raises(dp.RecipeError) as caught:
        dp.Recipe(**SYNC_CASES[name])
    assert caught.value.field == name
    assert str(caught.value).startswith(f"Recipe.{name}: ")
    assert "{" not in str(caught.value)
    with pytest.raises(ConfigError) as cli:
        check_run_recipe(RunConfig().replace(sync=SYNC_CASES[name]))
    flag = "--" + name.replace("_", "-")
    assert cli.value.field == f"{flag} (sync.{name})"
    assert caught.value.problem_text.replace("{", "").replace("}", "") in str(caught.value)


def test_fixes_name_fields_as_the_caller_spells_them():
    with pytest.raises(dp.RecipeError) as caught:
        dp.Recipe(local_sgd=2, diloco=2)
    assert str(caught.value) == (
        "Recipe.diloco: local SGD and DiLoCo are both asked for; choose one: local_sgd H or "
        "diloco H"
    )
    assert caught.value.spelled({"local_sgd": "--local-sgd", "diloco": "--diloco"}) == (
        "local SGD and DiLoCo are both asked for",
        "choose one: --local-sgd H or --diloco H",
    )


def test_the_rules_that_need_the_model_are_the_compositions():
    """bf16 compression under bf16 parameters, and a PowerSGD rank above every matrix's smaller
    side (here 8 x 4: at most 4), refused by dp.check_recipe, which compose calls first."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    with pytest.raises(dp.RecipeError, match=r"Recipe.compress: gradients are already bf16 "
                       "under precision bf16-params; drop compress"):  # fmt: skip
        dp.check_recipe(dp.Recipe(compress="bf16", precision="bf16-params"), model)
    with pytest.raises(dp.RecipeError, match=r"rank=5 exceeds .* \(at most 4, its smaller side\); "
                       "use rank <= 4"):  # fmt: skip
        dp.check_recipe(dp.Recipe(compress="powersgd:rank=5"), model)
    dp.check_recipe(dp.Recipe(compress="powersgd:rank=4"), model)
    dp.check_recipe(dp.Recipe(compress="powersgd"), model)  # the default rank is cut to fit
    dp.check_recipe(dp.Recipe(compress="bf16", precision="bf16"), model)

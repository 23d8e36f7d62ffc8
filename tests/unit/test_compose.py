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


# One bad value per transform field ([Note: composition] 1-3): the error names it.
TRANSFORM_CASES = [
    ({"tp": 0}, "tp", "Recipe.tp: 0 is not an integer >= 1; give 1 (off) or more ranks"),
    ({"tp": 2.0}, "tp", "Recipe.tp: 2.0 is not an integer >= 1"),
    ({"tp": True}, "tp", "Recipe.tp: True is not an integer >= 1"),
    (
        {"activation_checkpointing": "yes"},
        "activation_checkpointing",
        "Recipe.activation_checkpointing: 'yes' is not True or False; give a bool",
    ),
    ({"compile": 1}, "compile", "Recipe.compile: 1 is not True or False; give a bool"),
]


@pytest.mark.parametrize("fields, field, message", TRANSFORM_CASES)
def test_a_transform_field_names_itself(fields, field, message):
    with pytest.raises(dp.RecipeError) as caught:
        dp.Recipe(**fields)
    assert caught.value.field == field
    assert str(caught.value).startswith(message)


def test_the_transform_cases_cover_every_transform_field():
    assert len(TRANSFORM_CASES) == 5
    assert {field for _, field, _ in TRANSFORM_CASES} == {
        "tp",
        "activation_checkpointing",
        "compile",
    }
    recipe = dp.Recipe()  # off by default: every compose call of before is unchanged
    assert (recipe.tp, recipe.activation_checkpointing, recipe.compile) == (1, False, False)


def test_the_transform_rules_that_need_the_model_or_the_world():
    """tp needs the model's plan, a tp that divides its heads and the world's ranks;
    activation_checkpointing needs blocks. dp.check_recipe says so and changes nothing."""
    import torch

    from dataparallel.activation_checkpointing import is_checkpointed
    from dataparallel.models import GPT, GPTConfig

    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    no_blocks = (
        "Recipe.activation_checkpointing: blocks selected no module of Sequential (it has no "
        "nn.ModuleList); drop it, or name the blocks: dp.checkpoint_activations(model, blocks=...)"
    )
    refused = [
        (dp.Recipe(tp=2), mlp, None, "Recipe.tp: Sequential has no tensor-parallel plan; give"),
        (dp.Recipe(tp=4), gpt, None, "Recipe.tp: 4 does not divide the GPT's 2 heads; use a"),
        (dp.Recipe(tp=2), gpt, 3, "Recipe.tp: 2 does not divide the 3 ranks; use a divisor"),
        (dp.Recipe(activation_checkpointing=True), mlp, None, no_blocks),
    ]
    for recipe, model, world_size, message in refused:
        with pytest.raises(dp.RecipeError) as caught:
            dp.check_recipe(recipe, model, world_size)
        assert str(caught.value).startswith(message), str(caught.value)
    assert len(refused) == 4
    dp.check_recipe(dp.Recipe(tp=2, activation_checkpointing=True, compile=True), gpt, 4)
    assert not is_checkpointed(gpt)
    plan = gpt.tensor_parallel_plan(2)
    split = ("attn.k", "attn.proj", "attn.q", "attn.v", "mlp.0", "mlp.2")
    assert sorted(plan) == [f"blocks.*.{name}" for name in split]


def test_the_job_spells_the_transform_fields_as_its_flags():
    """--tp and --activation-checkpointing fill Recipe.tp and .activation_checkpointing; their
    errors name the flag and the TOML key (train/sync.py FIELDS)."""
    from dataparallel.train.config import ConfigError, RunConfig
    from dataparallel.train.sync import check_run_recipe, recipe_of

    config = RunConfig().replace(launch={"tp": 2}, train={"activation_checkpointing": True})
    recipe = recipe_of(config, "ddp")
    assert (recipe.tp, recipe.activation_checkpointing, recipe.compile) == (2, True, False)
    with pytest.raises(ConfigError) as cli:
        check_run_recipe(RunConfig().replace(launch={"tp": 0}))
    assert cli.value.field == "--tp (launch.tp)"

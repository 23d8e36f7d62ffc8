"""The run's `dp.Recipe`: which config field fills each recipe field, and the recipe's errors
spelled with the flags.

The rules on the [sync] section (and on the precision and the mesh they combine with) are the
library's, in one home ([Note: one home for the recipe's rules] in dataparallel/recipe.py):
`dp.Recipe` checks its fields, `dp.check_recipe` the ones that need the model; each raises a
`dp.RecipeError` naming its field, which `check_run_recipe` below turns into the one-line
`ConfigError` of the field's flag. The [sync] section itself is Recipe fields with the Recipe's
defaults (`SyncConfig`, built by `recipe_section` in config.py). The composition itself (in which order tensor parallelism,
activation checkpointing, precision, the mesh, compression and an averager apply) is
[Note: composition], which the trainer calls.
"""

from __future__ import annotations

from dataclasses import fields

from torch import nn

import dataparallel as dp

from .config import ConfigError, RunConfig, SyncConfig, field_label, flag_name

# dp.Recipe field -> the config's (section, field) that gives it; "elastic" is
# `launch.recovery == "live"`.
FIELDS: dict[str, tuple[str, str]] = {
    "tp": ("launch", "tp"),  # [Note: composition] 1-2: the split and the recompute
    "activation_checkpointing": ("train", "activation_checkpointing"),
    "strategy": ("launch", "strategy"),
    "shard_size": ("launch", "shard_group"),
    "precision": ("train", "precision"),
    **{f.name: ("sync", f.name) for f in fields(SyncConfig)},
    "lr_warmup": ("optim", "warmup_steps"),  # the recipe's DiLoCo warm-up lasts the longer of
    "run_steps": ("train", "steps"),  # the two: the LR's warm-up, a tenth of the run
    "elastic": ("launch", "recovery"),  # [Note: HSDP replicas] in live/replica.py
}
FLAGS = {name: flag_name(*where) for name, where in FIELDS.items()}


def recipe_of(config: RunConfig, strategy) -> dp.Recipe:
    """What `dp.compose` is given for this run ([Note: composition]): --tp,
    --activation-checkpointing, the [sync] section, the precision and the mesh; `strategy` is
    the config's name or the policy the model needs. A `dp.RecipeError` if a field breaks a
    rule (`check_run_recipe` spells it with the flags)."""
    given = {name: getattr(getattr(config, s), n) for name, (s, n) in FIELDS.items()}
    given.update(strategy=strategy, elastic=config.launch.recovery == "live")
    return dp.Recipe(**given)


def check_run_recipe(config: RunConfig, model: nn.Module | None = None) -> dp.Recipe:
    """The run's recipe, checked by the library (`dp.Recipe`, and `dp.check_recipe` against
    `model`, built on the meta device, when given); its error as a `ConfigError` that names
    the flag and the TOML key."""
    try:
        recipe = recipe_of(config, config.launch.strategy)
        if model is not None:
            dp.check_recipe(recipe, model)
    except dp.RecipeError as error:
        problem, fix = error.spelled(FLAGS)
        raise ConfigError(field_label(*FIELDS[error.field]), problem, fix) from None
    return recipe


def averaging(config: RunConfig) -> bool:
    return bool(config.sync.local_sgd or config.sync.diloco)

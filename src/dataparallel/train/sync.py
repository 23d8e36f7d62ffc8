"""What the [sync] section means to the CLI: its checks, with the flags' names in the errors.

The composition itself (in which order precision, the mesh, compression and an averager apply)
is the library's: [Note: composition] in dataparallel/compose.py, which the trainer calls.
"""

from __future__ import annotations

import torch

import dataparallel as dp

from ..averaging.streaming import RECIPE, check_streaming, short_run_recipe
from ..compression import SPEC_HELP, PowerSGD, build_hook, parse_spec
from .config import ConfigError, RunConfig, field_label

OUTER_COMPRESS = dp.OUTER_COMPRESS


def check_sync(config: RunConfig, model_shapes: list[torch.Size] | None = None) -> None:
    """One-line errors for a [sync] section that cannot work (no I/O)."""
    sync, precision = config.sync, config.train.precision
    for name in ("local_sgd", "diloco"):
        value = getattr(sync, name)
        if value < 0:
            raise ConfigError(
                field_label("sync", name), f"{value} is below 1", "give H >= 1 steps, or 0 for off"
            )
    if sync.local_sgd and sync.diloco:
        raise ConfigError(
            field_label("sync", "diloco"),
            "local SGD and DiLoCo are both asked for",
            "choose one: --local-sgd H or --diloco H",
        )
    if not sync.outer_lr > 0:
        raise ConfigError(
            field_label("sync", "outer_lr"), f"{sync.outer_lr} is not positive", "use e.g. 0.7"
        )
    if not 0 <= sync.outer_momentum < 1:
        raise ConfigError(
            field_label("sync", "outer_momentum"),
            f"{sync.outer_momentum} is outside [0, 1)",
            "use e.g. 0.9, or 0 for plain SGD",
        )
    if sync.outer_compress not in OUTER_COMPRESS:
        raise ConfigError(
            field_label("sync", "outer_compress"),
            f"unknown value {sync.outer_compress!r}",
            "choose recipe, fp32, bf16, int8, fp8 or int4",
        )
    if sync.outer_compress not in ("recipe", "") and not sync.diloco:
        raise ConfigError(
            field_label("sync", "outer_compress"),
            "only DiLoCo has outer gradients",
            "add --diloco H, or drop --outer-compress",
        )
    _check_streaming(sync)
    if not sync.compress:
        return
    label = field_label("sync", "compress")
    if sync.local_sgd or sync.diloco:
        raise ConfigError(
            label,
            "gradients are reduced only inside a replica under local SGD or DiLoCo",
            "drop --compress; compress DiLoCo's outer gradients with --outer-compress",
        )
    try:
        name, options = parse_spec(sync.compress)
        build_hook(sync.compress)  # the compressors check their own options
    except ValueError as error:
        raise ConfigError(label, str(error), f"write it as {SPEC_HELP}") from None
    if name in ("bf16", "fp16") and precision in ("bf16-params", "fp16"):
        raise ConfigError(
            label,
            f"gradients are already {precision.removesuffix('-params')} under --precision "
            f"{precision}",
            "drop --compress, or compress further with int8, topk or powersgd",
        )
    if name == "powersgd" and "rank" in options and model_shapes is not None:
        # the default rank is cut to each matrix's smaller side; a rank asked for is checked
        rank, largest = options["rank"], PowerSGD.largest_rank(model_shapes)
        if rank > largest:
            raise ConfigError(
                label,
                f"rank={rank} exceeds what any gradient matrix of {config.model.name} allows "
                f"(at most {largest}, its smaller side)",
                f"use rank <= {largest}",
            )


def averaging(config: RunConfig) -> bool:
    return bool(config.sync.local_sgd or config.sync.diloco)


def _check_streaming(sync) -> None:
    """--fragments, --overlap and --mix against --diloco ([Note: streaming DiLoCo])."""
    if not sync.diloco:
        for name, off in (("fragments", 1), ("overlap", 0), ("outer_warmup", 0)):
            if getattr(sync, name) not in (RECIPE, off):
                raise ConfigError(
                    field_label("sync", name),
                    "only DiLoCo streams fragments",
                    f"add --diloco H, or drop --{name.replace('_', '-')}",
                )
        return
    if sync.outer_warmup < RECIPE:
        raise ConfigError(
            field_label("sync", "outer_warmup"),
            f"{sync.outer_warmup} is below 0",
            "give N >= 0, or -1 for the recipe's",
        )
    streaming = short_run_recipe(sync.diloco, sync.fragments, sync.overlap)
    try:
        check_streaming(sync.diloco, streaming.fragments, streaming.overlap, sync.mix)
    except ValueError as error:
        text = str(error).removeprefix("diloco: ")
        name = text.split("=", 1)[0]  # the field the message starts with
        raise ConfigError(field_label("sync", name), text, "see docs/compression.md") from None


def recipe_of(config: RunConfig, strategy) -> dp.Recipe:
    """What `dp.compose` is given for this run ([Note: composition]): the [sync] section, the
    precision and the mesh; `strategy` is the config's name or the policy the model needs."""
    sync = config.sync
    return dp.Recipe(
        strategy=strategy,
        shard_size=config.launch.shard_group,
        precision=config.train.precision,
        compress=sync.compress,
        local_sgd=sync.local_sgd,
        diloco=sync.diloco,
        outer_lr=sync.outer_lr,
        outer_momentum=sync.outer_momentum,
        outer_compress=sync.outer_compress,
        fragments=sync.fragments,
        overlap=sync.overlap,
        mix=sync.mix,
        outer_warmup=sync.outer_warmup,
        lr_warmup=config.optim.warmup_steps,  # the recipe's DiLoCo warm-up lasts the longer
        run_steps=config.train.steps,  # of the two: the LR's warm-up, a tenth of the run
        elastic=config.launch.recovery == "live",  # [Note: HSDP replicas] in replica.py
    )

"""Checks of a run's configuration, done before any worker starts and before anything is written.

Each problem raises a `ConfigError` naming the field (flag and TOML key), the problem and the
fix; the CLI prints it on one line and exits with status 2. The checks only read: config values,
file names and sizes, and the output directory's listing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import dataparallel as dp

from ..checkpoint import latest_checkpoint
from ..data.corpus import corpus_size, num_windows
from ..data.formats import DataError
from ..data.loading import check_sources, reads_bytes
from ..data.tokens import TOKEN_DTYPES
from ..launch.config import at_least, check_launch
from .config import ConfigError, RunConfig, field_label
from .model_source import RunModel, check_model
from .optimizers import OPTIMIZERS
from .run_dir import CHECKPOINTS
from .sync import averaging, check_run_recipe
from .tensor_parallel import check_tp
from .tracing import parse_steps
from .trackers import check_trackers

# Files that mark a directory as holding a run (see docs/train.md, "The run directory").
RUN_MARKERS = ("config.toml", "metrics.jsonl", "checkpoint", "model.safetensors")


def _choose(label: str, value: str, known) -> None:
    if value not in known:
        raise ConfigError(label, f"unknown value {value!r}", f"choose one of {', '.join(known)}")


def _at_least(config: RunConfig, section: str, name: str, minimum: float) -> None:
    at_least(section, name, getattr(getattr(config, section), name), minimum)


def resolve_batch(config: RunConfig) -> RunConfig:
    """Derive the per-rank batch from train.global_batch when it is set (> 0).

    When accum x world size divides it, the result records the derived batch and
    global_batch = 0, so that a resumed run (or one started from the written config.toml) with
    other flags derives nothing stale. Otherwise the micro-batches differ by at most one window
    ([Note: uneven batches] in trainer.py): batch records the largest and global_batch stays.
    """
    train = config.train
    if train.global_batch <= 0:
        return config
    world = config.layout.data_size  # tp peers read the same slice
    parts = train.accum * world
    if train.global_batch < parts:
        raise ConfigError(
            field_label("train", "global_batch"),
            f"{train.global_batch} windows leave some of the accum {train.accum} x {world} "
            f"ranks = {parts} micro-batches empty",
            f"use at least {parts} windows, or a smaller --accum",
        )
    if train.global_batch % parts:
        return config.replace(train={"batch": -(-train.global_batch // parts)})
    return config.replace(train={"batch": train.global_batch // parts, "global_batch": 0})


RECOVERY = ("restart", "live")


def check_recovery(config: RunConfig) -> None:
    """--recovery live covers one machine, DDP (with or without --compress; alone or inside
    each replica of local SGD or DiLoCo) and the precisions that keep DDP's plain replicas
    (docs/faults.md, "Live recovery"); say which flag stands in its way."""
    launch, label = config.launch, field_label("launch", "recovery")
    _choose(label, launch.recovery, RECOVERY)
    _check_sizes(config)
    if launch.recovery != "live":
        return
    hsdp = launch.shard_group > 1  # a replica of S ranks ([Note: HSDP replicas] in live/replica.py)
    sync = config.sync
    blockers = [
        ("strategy", launch.strategy != "ddp" and not hsdp,
         "--strategy ddp, or zero1/2/3 inside replicas of --shard-group S ranks"),
        ("precision", config.train.precision not in ("fp32", "bf16"), "--precision fp32 or bf16"),
        ("nnodes", launch.nnodes != 1, "one machine (--nnodes 1)"),
        ("tp", launch.tp != 1, "--tp 1"),
        ("shard_group", hsdp and bool(sync.compress or sync.local_sgd or sync.diloco),
         "--compress, --local-sgd or --diloco without --shard-group"),
        ("collective_timeout", launch.collective_timeout <= 0, "a --collective-timeout above 0"),
    ]  # fmt: skip
    for name, blocked, needs in blockers:
        if blocked:
            raise ConfigError(label, f"live recovery does not cover {name} yet", f"use {needs}")


def _check_sizes(config: RunConfig) -> None:
    """min_replicas <= nproc <= max_replicas (0: nproc), and only under --recovery live."""
    launch = config.launch
    for name in ("nproc", "min_replicas"):
        _at_least(config, "launch", name, 1)
    _at_least(config, "launch", "max_replicas", 0)
    given = [n for n, d in [("min_replicas", 1), ("max_replicas", 0), ("store_host", "")]
             if getattr(launch, n) != d]  # fmt: skip
    if given and launch.recovery != "live":
        raise ConfigError(
            field_label("launch", given[0]),
            "replicas join, leave and find the run's store only under --recovery live",
            "add --recovery live, or leave it out",
        )
    replicas, what, zero = launch.nproc, f"--nproc {launch.nproc}", "--nproc"
    divides = launch.shard_group > 1 and launch.nproc % launch.shard_group == 0
    if launch.recovery == "live" and divides:  # [Note: HSDP replicas] (else: --shard-group's)
        replicas = launch.nproc // launch.shard_group
        what = f"the run's {replicas} replicas (--nproc / --shard-group)"
        zero = "as many"
    if launch.min_replicas > replicas:
        raise ConfigError(
            field_label("launch", "min_replicas"),
            f"{launch.min_replicas} is above {what}",
            f"use at most {replicas}",
        )
    if launch.max_replicas and launch.max_replicas < replicas:
        raise ConfigError(
            field_label("launch", "max_replicas"),
            f"{launch.max_replicas} is below {what}",
            f"use at least {replicas}, or 0 for {zero}",
        )


def check_values(config: RunConfig, source: RunModel | None = None) -> None:
    """Check every value on its own and against the others (no I/O but an hf:DIR's config and
    tokenizer); `source`: the run's model, resolved once (default: resolved here)."""
    _choose(field_label("launch", "strategy"), config.launch.strategy, sorted(dp.STRATEGIES))
    check_recovery(config)
    _choose(field_label("train", "precision"), config.train.precision, sorted(dp.PRECISIONS))
    _choose(field_label("optim", "optimizer"), config.optim.optimizer, list(OPTIMIZERS))
    _choose(field_label("optim", "lr_scaling"), config.optim.lr_scaling, ["none", "linear"])
    _choose(field_label("data", "token_dtype"), config.data.token_dtype, TOKEN_DTYPES)
    _choose(
        field_label("train", "checkpoint_save"), config.train.checkpoint_save, ["async", "sync"]
    )
    for section, name, minimum in [
        ("train", "steps", 1),
        ("train", "batch", 1),
        ("train", "accum", 1),
        ("train", "log_every", 1),
        ("data", "block_size", 1),
        ("optim", "lr_base_batch", 1),
        ("train", "max_skips", 1),
    ] + [
        (s, n, 0)
        for s, n in [
            ("train", "global_batch"),
            ("train", "eval_every"),
            ("train", "checkpoint_every"),
            ("train", "stop_after"),
            ("data", "eval_windows"),
            ("optim", "warmup_steps"),
            ("optim", "weight_decay"),
            ("optim", "grad_clip"),
            ("launch", "shard_group"),
        ]
    ]:
        _at_least(config, section, name, minimum)
    optim, train, launch = config.optim, config.train, config.launch
    if not (math.isfinite(optim.lr) and optim.lr > 0):
        raise ConfigError(
            field_label("optim", "lr"), f"{optim.lr} is not a positive number", "use e.g. 1e-3"
        )
    ranges = [
        ("data", "val_fraction", 0.0 < config.data.val_fraction < 1.0, "(0, 1)"),
        ("optim", "min_lr_ratio", 0.0 <= optim.min_lr_ratio <= 1.0, "[0, 1]"),
        ("optim", "beta1", 0.0 <= optim.beta1 < 1.0, "[0, 1)"),
        ("optim", "beta2", 0.0 <= optim.beta2 < 1.0, "[0, 1)"),
    ]
    for section, name, ok, bounds in ranges:
        if not ok:
            value = getattr(getattr(config, section), name)
            raise ConfigError(
                field_label(section, name),
                f"{value} is outside {bounds}",
                f"use a value in {bounds}",
            )
    if train.stop_after > train.steps:
        raise ConfigError(
            field_label("train", "stop_after"),
            f"{train.stop_after} is after the last step ({train.steps})",
            f"use at most {train.steps}, or 0 to run all steps",
        )
    _check_trace(config)
    check_trackers(config.train.report_to)  # looked up, not imported
    check_launch(config.launch)
    # Under local SGD / DiLoCo the shard group is a replica, which may run DDP inside.
    if launch.shard_group and launch.strategy == "ddp" and not averaging(config):
        raise ConfigError(
            field_label("launch", "shard_group"),
            "ddp replicates everything and takes no shard group",
            "use zero1, zero2 or zero3, or 0 for none",
        )
    config.layout  # noqa: B018 - --tp and --shard-group against the ranks ([Note: layout])
    check_tp(config)
    source = source or RunModel(config.model)
    check_run_recipe(config, check_model(config, source))  # reads an hf:DIR's config, tokenizer


def _check_trace(config: RunConfig) -> None:
    """--trace parses and lies within the run's steps."""
    train, label = config.train, field_label("train", "trace")
    if not train.trace:
        return
    try:
        _, last = parse_steps(train.trace)
    except ValueError as error:
        raise ConfigError(label, str(error), "write e.g. --trace 10-12, or --trace 5") from None
    end = train.stop_after or train.steps
    if last > end:
        raise ConfigError(
            label,
            f"{train.trace!r} goes past the run's last step ({end})",
            f"trace steps between 1 and {end}",
        )


def check_data(config: RunConfig, source: RunModel | None = None) -> None:
    """The data exists and is readable, its formats open and every record not yet cached has
    its fields, token files hold only ids of the run's tokenizer (data/loading.py
    check_sources), and text read as bytes gives every rank at least one window (other data is
    counted once tokenized, by the loader)."""
    label = field_label("data", "paths")
    tokenizer = (source or RunModel(config.model)).tokenizer()
    try:
        files = check_sources(
            list(config.data.paths), tokenizer, token_dtype=config.data.token_dtype
        )
    except DataError as error:
        raise ConfigError(label, error.problem, error.fix) from None
    except (OSError, ValueError) as error:
        raise ConfigError(label, str(error), "give readable files or folders") from None
    if not reads_bytes(files, tokenizer):
        return
    total = corpus_size([path for path, _ in files])
    block = config.data.block_size
    val_tokens = int(total * config.data.val_fraction)
    train_windows = num_windows(total - val_tokens, block)
    val_windows = num_windows(val_tokens, block)
    if train_windows < config.world_size:
        raise ConfigError(
            field_label("launch", "nproc"),
            f"{config.world_size} ranks but only {train_windows} training windows of {block} "
            f"tokens in {total} bytes of text",
            "use fewer workers, a smaller --block-size, or more text",
        )
    if val_windows < 1:
        raise ConfigError(
            field_label("data", "val_fraction"),
            f"the validation split ({val_tokens} bytes) holds no window of {block + 1} tokens",
            "raise --val-fraction, lower --block-size, or give more text",
        )


def check_run_dir(path: Path, *, resume: bool, again: bool = False) -> None:
    """A new run needs an empty or missing directory; --resume needs a run with a checkpoint.
    again (`--resume auto` with no checkpoint found): the directory may hold an earlier start
    of the same command that saved none; it is started over."""
    label = field_label("launch", "out")
    if path.exists() and not path.is_dir():
        raise ConfigError(label, f"{path} is a file", "choose a directory")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if resume:
        if "config.toml" not in entries or latest_checkpoint(path / CHECKPOINTS) is None:
            raise ConfigError(
                "--resume",
                f"{path} holds no run with a checkpoint",
                "give the directory of a run that saved one",
            )
        return
    existing = next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(label, f"cannot write in {existing}", "choose a writable directory")
    markers = [m for m in RUN_MARKERS if m in entries]
    if again and "config.toml" in markers and "model.safetensors" not in markers:
        return
    if markers:
        raise ConfigError(
            label,
            f"{path} holds another run ({', '.join(markers)})",
            f"choose a new --out, or continue that run with --resume {path}",
        )
    if entries:
        raise ConfigError(label, f"{path} is not empty", "choose a new or empty directory")


def keep_global_batch(base: RunConfig, config: RunConfig, flags: dict) -> RunConfig:
    """A resumed run keeps the global batch it was trained with ([Note: resize]).

    [Note: resize] A checkpoint resumes on any number of ranks, under any strategy, with the
    global batch (windows per optimizer step) it was trained with: the learning rate (scaled
    by the global batch) and its schedule (a function of the step) then continue unchanged, and
    the data continues at the same global sample ([Note: global sample position] in
    data/stream.py). On a new number of ranks the micro-batch is kept and `accum` absorbs the
    change when it divides; otherwise `accum` is kept and the micro-batch changes; when neither
    divides, the ranks share the global batch unevenly ([Note: uneven batches] in trainer.py),
    with `accum` lowered if it would leave a micro-batch empty. Only more ranks than windows
    is refused.
    """
    target, ranks = base.global_batch, config.layout.data_size
    if config.global_batch == target:
        return config
    if {"batch", "accum", "global_batch"} & set(flags):
        raise ConfigError(
            "--batch / --accum / --global-batch",
            f"the run was trained with a global batch of {target} windows, these flags give "
            f"{config.global_batch}",
            f"keep batch x accum x ranks = {target}, or leave the flags out",
        )
    if target < ranks:
        raise ConfigError(
            "--nproc (launch.nproc)",
            f"{ranks} ranks cannot share the run's global batch of {target} windows (one "
            "would get none)",
            f"use at most {target} ranks",
        )
    batch, accum = base.train.batch, base.train.accum
    if target % (batch * ranks) == 0:
        return config.replace(train={"accum": target // (batch * ranks), "global_batch": 0})
    accum = min(accum, target // ranks)
    return resolve_batch(config.replace(train={"accum": accum, "global_batch": target}))


def check_checkpoint(config: RunConfig, name: str = "", source: RunModel | None = None) -> None:
    """The checkpoint a --resume continues from: intact, readable without running code, and of
    this model (one line naming the file, or the first differing parameter)."""
    from ..checkpoint import CheckpointError, check_same_model, read_metadata, verify
    from .checkpointing import resolve_checkpoint

    try:
        path = resolve_checkpoint(Path(config.launch.out), name)
        plain = verify(path)
        read_metadata(path)
    except CheckpointError as error:
        raise ConfigError("--resume", str(error), "resume from an intact checkpoint") from None
    except Exception as error:  # noqa: BLE001 - an unpickling refusal, or not a DCP index
        raise ConfigError(
            "--resume",
            f"{path / '.metadata'} cannot be read safely ({error})",
            "resume from a checkpoint that dataparallel wrote",
        ) from None
    try:
        check_same_model((source or RunModel(config.model)).meta_model(), plain["shapes"])
    except ValueError as error:
        raise ConfigError(field_label("model", "name"), str(error), "keep the model") from None


def check_same_command(config: RunConfig) -> bool:
    """`--resume auto`: whether the run directory holds a checkpoint to resume from; the run
    there must have the global batch of this command (the model is checked with the
    checkpoint, `check_checkpoint`)."""
    run_dir = Path(config.launch.out)
    if latest_checkpoint(run_dir / CHECKPOINTS) is None or not (run_dir / "config.toml").is_file():
        return False
    from .config_toml import load_toml

    theirs = resolve_batch(load_toml(run_dir / "config.toml")).global_batch
    if theirs != config.global_batch:
        raise ConfigError(
            "--resume auto",
            f"the run in {run_dir} has a global batch of {theirs} windows, this command "
            f"{config.global_batch}",
            "give the command that started it, or another --out",
        )
    return True


def preflight(
    config: RunConfig, *, resume: bool, checkpoint: str = "", again: bool = False
) -> None:
    """Every check, cheapest first, on the run's model resolved once ([Note: a run's model]).
    again: `--resume auto` ([Note: preemption] in launch/preemption.py)."""
    source = RunModel(config.model)
    check_values(config, source)
    if config.launch.node_rank == 0:  # only node 0 writes the run directory
        check_run_dir(Path(config.launch.out), resume=resume, again=again)
        if resume:
            check_checkpoint(config, checkpoint, source)
    check_data(config, source)

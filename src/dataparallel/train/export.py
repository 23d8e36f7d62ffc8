"""`dataparallel export RUN_OR_CHECKPOINT --out DIR`: the weights of any complete checkpoint,
not only the final one, in the files the ecosystem reads.

    DIR/model.safetensors   the model's state dict (every name, tied ones included), with the
                            metadata `dataparallel sample` rebuilds a built-in model from
    DIR/hf/                 for a run of an hf:DIR model: a save_pretrained directory (LoRA
                            merged, the adapters beside it), as the run's own RUN/hf

RUN_OR_CHECKPOINT is a run directory (its latest complete checkpoint) or one checkpoint folder
(RUN/checkpoint/step-N). One process, no process group: each tensor is read from the chunks
of whatever ranks and strategy wrote it, one at a time, so no more than one is in memory. The
checkpoint's files are checked against its manifest first; bad input is refused in one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint import CheckpointError, latest_checkpoint, verify
from ..checkpoint.folders import MANIFEST
from ..launch.command import add_command, refused
from .checkpointing import FINAL_WEIGHTS, checkpoint_weights, export_weights
from .config import ConfigError
from .export_hf import HF_EXPORT, export_hf
from .run_dir import CHECKPOINTS

CONFIG_FILE = "config.toml"  # the run's resolved config (worker.py writes it)


def find_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """(the checkpoint folder, its run directory or None) of a run directory or a checkpoint
    folder; CheckpointError (one line) when there is none."""
    given = Path(path)
    if (given / MANIFEST).is_file():
        run = given.parent.parent if given.parent.name == CHECKPOINTS else None
        return given, run if run is not None and (run / CONFIG_FILE).is_file() else None
    if given.name.startswith("step-") and given.is_dir():
        raise CheckpointError(
            f"{given} is not a complete checkpoint (it has no {MANIFEST}); give a committed "
            f"step-N folder or the run directory"
        )
    if not given.is_dir():
        raise CheckpointError(f"{given} is no run directory or checkpoint folder; check the path")
    latest = latest_checkpoint(given / CHECKPOINTS)
    if latest is None:
        raise CheckpointError(
            f"{given} has no complete checkpoint under {CHECKPOINTS}/; give a run directory "
            "that saved one (--checkpoint-every, or a finished run)"
        )
    return latest, given


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write DIR (`out`) from the checkpoint `path` names (see the module docstring); the
    checkpoint folder exported."""
    checkpoint, run = find_checkpoint(path)
    verify(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    export_weights(checkpoint, out / FINAL_WEIGHTS)
    source = _hf_source(run)
    if source is not None:
        entries, read, _ = checkpoint_weights(checkpoint)
        export_hf(entries, read, out / HF_EXPORT, source.opened(), source.meta_model())
    return checkpoint


def _hf_source(run: Path | None):
    """The run's model source when it trained an hf:DIR model, else None."""
    if run is None:
        return None
    from .config_toml import load_toml
    from .model_source import RunModel

    source = RunModel(load_toml(run / CONFIG_FILE).model)
    return source if source.path is not None else None


def add_export_parser(commands) -> None:
    parser = add_command(commands, "export", cmd_export)
    parser.add_argument(
        "checkpoint",
        metavar="RUN_OR_CHECKPOINT",
        help="a run directory (its latest checkpoint) or RUN/checkpoint/step-N",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write")


def cmd_export(args: argparse.Namespace) -> int:
    """write a checkpoint's weights as safetensors (and an hf/ directory)

    Write the weights of a run's latest checkpoint, or of RUN/checkpoint/step-N, as
    DIR/model.safetensors, and for an hf:DIR model a save_pretrained DIR/hf.
    """
    try:
        checkpoint = export_checkpoint(args.checkpoint, args.out)
    except (CheckpointError, ConfigError) as error:
        return refused("export", error)
    print(f"exported {checkpoint} to {args.out}")
    return 0

"""Checkpoint files: model weights as safetensors, the training state for --resume.

Layout of a run directory's `checkpoint/` folder:

    checkpoint/latest              name of the newest complete checkpoint ("step-000200")
    checkpoint/step-000200/model.safetensors   weights, plain tensors (see `save_weights`)
    checkpoint/step-000200/train_state.pt      optimizer, scheduler, sampler, step (torch.save)

[Note: atomic checkpoints] A crash (or Ctrl-C) while writing must never leave a checkpoint that
looks complete but is not. Files go into `step-N.tmp/`, which is renamed to `step-N/` once
everything in it is written and flushed (a directory rename is atomic on POSIX), and only then
is `latest` replaced (written to a temporary file and renamed over the old one). A reader
follows `latest`, so it sees the previous checkpoint or the new one, never half of one. Older
step folders are deleted after `latest` moves on.

Everything here is plain data: `safetensors.torch.load_file` or `torch.load(...,
weights_only=True)` read these files without this package.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
TRAIN_STATE = "train_state.pt"
LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_weights(path: Path, state_dict: dict[str, torch.Tensor], metadata: dict) -> None:
    """Save a model state dict as safetensors, with `metadata` (JSON-able) stored in it.

    Tied weights (GPT's output head shares the embedding) are one storage under two names;
    safetensors refuses shared storage, so each name gets its own contiguous copy. The file is
    then a plain name -> tensor mapping that `model.load_state_dict(load_file(path))` accepts
    as is, at the price of storing the tied matrix twice.
    """
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in state_dict.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def read_weights_metadata(path: Path) -> dict:
    """The metadata `save_weights` stored (decoded from JSON)."""
    with safe_open(str(path), framework="pt") as handle:
        raw = handle.metadata() or {}
    return {k: json.loads(v) for k, v in raw.items()}


def save_checkpoint(
    folder: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    metadata: dict,
    train_state: dict,
    keep: int = 1,
) -> Path:
    """Write checkpoint `step` under `folder` atomically ([Note: atomic checkpoints]).

    Call on one rank only (rank 0). Returns the checkpoint's folder. `keep` is how many of the
    newest checkpoints to keep.
    """
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = folder / name
    tmp = folder / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_weights(tmp / WEIGHTS, weights, dict(metadata, step=step))
    with open(tmp / TRAIN_STATE, "wb") as handle:
        torch.save(dict(train_state, step=step), handle)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step written again (a resumed run that stops where it began)
        shutil.rmtree(final)
    os.rename(tmp, final)
    atomic_write_bytes(folder / LATEST, name.encode())
    _fsync_dir(folder)
    steps = sorted(p for p in folder.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None if there is none."""
    try:
        name = (folder / LATEST).read_text().strip()
    except OSError:
        return None
    path = folder / name
    return path if (path / WEIGHTS).is_file() and (path / TRAIN_STATE).is_file() else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, train_state) of the checkpoint folder `path`, with plain torch loaders only."""
    from safetensors.torch import load_file

    weights = load_file(str(path / WEIGHTS))
    train_state = torch.load(path / TRAIN_STATE, map_location="cpu", weights_only=True)
    return weights, train_state

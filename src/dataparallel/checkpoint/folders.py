"""Checkpoint folders: written aside, checked, committed atomically; and the exported weights.

Layout of a run directory's `checkpoint/` folder:

    checkpoint/latest                      name of the newest complete checkpoint ("step-000200")
    checkpoint/step-000200/.metadata       DCP's index of the chunks (read without unpickling)
    checkpoint/step-000200/__<r>_0.distcp  rank r's chunks (torch.save, read with weights_only)
    checkpoint/step-000200/train_state.json  step, data position, scaler, layout (plain JSON)
    checkpoint/step-000200/manifest.json   size and CRC-32 of every file above

[Note: atomic checkpoints] A crash, a `kill -9` or Ctrl-C while writing must never leave a
checkpoint that looks complete but is not. Every rank writes into `step-N.tmp/`; once all have
finished (DCP's save ends with the coordinator's `.metadata`, written after every rank reported
its files), rank 0 writes train_state.json and the manifest, flushes the folder, renames it to
`step-N/` (a directory rename is atomic on POSIX), and only then replaces `latest` (written to
a temporary file and renamed over the old one). A reader follows `latest`, so it sees the
previous checkpoint or the new one, never half of one; leftover `.tmp` folders are removed by
the next save. The `keep` newest checkpoints stay (two by default), so when the newest one is
damaged on disk after the fact (the manifest says which file), the one before is still there:
`--resume RUN/checkpoint/step-N` resumes from it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

LATEST = "latest"
TRAIN_STATE = "train_state.json"
MANIFEST = "manifest.json"
KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, damaged, or not ours); one line."""


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


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def begin(folder: Path, step: int) -> Path:
    """A fresh `step-N.tmp/` to write checkpoint `step` into (rank 0 calls it; stale
    `.tmp` folders of interrupted saves are removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder / (step_name(step) + ".tmp")
    tmp.mkdir()
    return tmp


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def commit(tmp: Path, train_state: dict, keep: int = KEEP) -> Path:
    """Finish checkpoint `tmp` (every rank's files are in it): write train_state.json and
    the manifest, rename it to its final name, point `latest` at it, drop older ones."""
    atomic_write_bytes(tmp / TRAIN_STATE, json.dumps(train_state, indent=1).encode())
    files = sorted(p for p in tmp.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
    manifest = {p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in files}
    atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)
    folder = tmp.parent
    final = folder / tmp.name.removesuffix(".tmp")
    if final.exists():  # the same step written again (a resumed run that stops where it began)
        shutil.rmtree(final)
    os.rename(tmp, final)
    atomic_write_bytes(folder / LATEST, final.name.encode())
    _fsync_dir(folder)
    for old in complete_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(folder: Path) -> list[Path]:
    """The committed checkpoints under `folder`, oldest first."""
    return sorted(p for p in folder.glob("step-*") if (p / MANIFEST).is_file())


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint `latest` names under `folder`, or None if there is none."""
    try:
        name = (folder / LATEST).read_text().strip()
    except OSError:
        return None
    path = folder / name
    return path if (path / MANIFEST).is_file() else None


def verify(path: Path) -> dict:
    """Check every file of checkpoint `path` against its manifest; return its train state.
    Raises CheckpointError naming the first damaged file and the checkpoint before it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        why = f"{path / MANIFEST} cannot be read ({error}){_previous(path)}"
        raise CheckpointError(why) from None
    for name, expected in manifest.items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise CheckpointError(f"{file} is missing{_previous(path)}") from None
        if size != expected["bytes"] or _crc32(file) != expected["crc32"]:
            why = "truncated" if size < expected["bytes"] else "corrupted (its CRC-32 differs)"
            raise CheckpointError(f"{file} is {why}{_previous(path)}")
    return read_train_state(path)


def read_train_state(path: Path) -> dict:
    """The plain (JSON) state of checkpoint `path`, unchecked (`verify` checks the files)."""
    return json.loads((path / TRAIN_STATE).read_text())


def _previous(path: Path) -> str:
    earlier = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    if not earlier:
        return "; no earlier checkpoint is left"
    return f"; the previous checkpoint is intact: --resume {earlier[-1]}"


# -- the exported weights: one safetensors file, written one tensor at a time -----------------

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    path: Path, entries: list[tuple[str, list[int], torch.dtype]], read, metadata: dict
) -> None:
    """Write a safetensors file of `entries` (name, shape, dtype), asking `read(name)` for one
    tensor at a time, so no more than one is in memory. Written aside, then renamed."""
    # "format": "pt" as every PyTorch writer sets it (transformers refuses a file without it).
    header: dict = {
        "__metadata__": {"format": "pt", **{k: json.dumps(v) for k, v in metadata.items()}}
    }
    offset = 0
    for name, shape, dtype in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for name, shape, dtype in entries:
            tensor = read(name).reshape(shape).to(dtype).contiguous()
            handle.write(tensor.view(torch.uint8).numpy().tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_weights_metadata(path: Path) -> dict:
    """The metadata stored in an exported safetensors file (decoded from JSON)."""
    with safe_open(str(path), framework="pt") as handle:
        raw = handle.metadata() or {}
    return {k: json.loads(v) for k, v in raw.items() if k != "format"}

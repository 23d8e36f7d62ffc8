"""The token cache: a file's token ids (and loss mask), written once, read by every later run.

[Note: token cache] A file tokenized for training is cached beside it, in a hidden folder
`.dpcache` of the file's own folder (hidden, so that a `--data` folder never reads it back as
data), as `<file name>.<tokenizer fingerprint>.<content sha256>.npy`. The key is what decides
the ids: the tokenizer (its fingerprint, data/tokenizer.py) and the file's bytes, so editing
the file or changing the tokenizer gives a new entry and never a stale one; older entries of
the same file and tokenizer are removed once a run has all of its entries (prune). A piece of a
large file ([Note: chunks] in units.py) has an entry of its own, keyed by its own hash. When the
data's folder is not writable, or is the built-in corpus (the Python installation), the cache
is $XDG_CACHE_HOME/dataparallel/tokens (default ~/.cache/dataparallel/tokens).

An entry is one `.npy` array: 1-D ids for text (every token a target), or 2 rows, ids and the
loss mask (1 where the token is a target), for prompt/completion and chat data. uint16 when the
tokenizer's ids fit, else uint32. It is written to a temporary name in the same folder and
renamed into place (an atomic rename on POSIX), so a run killed mid-write leaves no entry that
a later run could take for a whole one: at worst a temporary file, which is ignored.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from .corpus import stdlib_root

CACHE_DIR = ".dpcache"


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def cache_folder(path: Path) -> Path:
    """Where `path`'s cache entries live ([Note: token cache])."""
    beside = path.parent / CACHE_DIR
    builtin = path.is_relative_to(stdlib_root())  # never write into the Python installation
    if not builtin and os.access(beside if beside.is_dir() else path.parent, os.W_OK | os.X_OK):
        return beside
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "dataparallel" / "tokens"


def entry_path(path: Path, fingerprint: str, sha256: str) -> Path:
    """The cache entry of `path` (with content hash `sha256`) tokenized by `fingerprint`."""
    return cache_folder(path) / f"{path.name}.{fingerprint}.{sha256}.npy"


def read_entry(entry: Path) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(ids, mask or None) of a cache entry, memory-mapped; None when there is none."""
    if not entry.is_file():
        return None
    array = np.load(entry, mmap_mode="r", allow_pickle=False)
    return (array, None) if array.ndim == 1 else (array[0], array[1])


def write_entry(entry: Path, ids: np.ndarray, mask: np.ndarray | None) -> None:
    """Write a cache entry atomically ([Note: token cache])."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    array = ids if mask is None else np.stack([ids, mask.astype(ids.dtype)])
    handle, temporary = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".npy")
    try:
        with os.fdopen(handle, "wb") as stream:
            np.save(stream, array, allow_pickle=False)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the entry from other users
        os.replace(temporary, entry)  # [Note: token cache]: atomic
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def prune(in_use: set[Path]) -> None:
    """Remove the entries of the files and tokenizers of `in_use` that are not in it (the
    entries of an older version of a file)."""
    for entry in in_use:
        name, fingerprint, _, _ = entry.name.rsplit(".", 3)
        for old in entry.parent.glob(f"{_escape(name)}.{_escape(fingerprint)}.*.npy"):
            if old not in in_use and old.name.count(".") == entry.name.count("."):
                old.unlink(missing_ok=True)


def _escape(text: str) -> str:
    """`text` with glob's special characters taken literally."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)

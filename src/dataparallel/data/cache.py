"""The token cache: a file's token ids (and loss mask), written once, read by every later run.

[Note: token cache] A file tokenized for training is cached beside it, in a hidden folder
`.dpcache` of the file's own folder (hidden, so that a `--data` folder never reads it back as
data), as `<file name>.<tokenizer fingerprint>.<content sha256>.npy`. The key is what decides
the ids: the tokenizer (its fingerprint, data/tokenizer.py) and the file's bytes, so editing
the file or changing the tokenizer gives a new entry and never a stale one; older entries of
the same file and tokenizer are removed once a run has all of its entries (prune). A piece of a
large file ([Note: chunks] in units.py) has an entry of its own, keyed by its own hash.

Elsewhere: $DATAPARALLEL_CACHE_DIR when set (`--cache-dir` of `dataparallel train` and `eval`
sets it, over the user's, for the workers it starts); else, when the data's folder is not
writable or is the built-in corpus (the Python installation), $XDG_CACHE_HOME/dataparallel/tokens
(default ~/.cache/dataparallel/tokens). Under either, an entry sits in the path of its file's
folder (DIR/data/a/x.jsonl.<...>.npy for /data/a/x.jsonl), so that files of one name in two
folders never prune each other's entries. The place is the machine's, not the run's: it is not
in the run's config, and a run that finds no entry tokenizes again.

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
from .formats import DataError

CACHE_DIR = ".dpcache"
CACHE_ENV = "DATAPARALLEL_CACHE_DIR"


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def use_cache_dir(folder: str | None) -> None:
    """`--cache-dir`: the cache in `folder` for this process and the workers it starts, which
    inherit its environment; the flag wins over a DATAPARALLEL_CACHE_DIR already set. None
    leaves the environment as it is."""
    if folder:
        os.environ[CACHE_ENV] = str(Path(folder).expanduser().absolute())


def cache_folder(path: Path) -> Path:
    """Where `path`'s cache entries live ([Note: token cache])."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return _mirrored(Path(given).expanduser(), path)
    beside = path.parent / CACHE_DIR
    builtin = path.is_relative_to(stdlib_root())  # never write into the Python installation
    if not builtin and os.access(beside if beside.is_dir() else path.parent, os.W_OK | os.X_OK):
        return beside
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return _mirrored(Path(home) / "dataparallel" / "tokens", path)


def check_outside(paths: list[str]) -> None:
    """DataError when the folder given for the cache is inside a folder of the data, whose walk
    (data/corpus.py user_files) would read its entries back as token files: only hidden folders
    are skipped."""
    given = os.environ.get(CACHE_ENV)
    if not given:
        return
    folder = Path(given).expanduser().resolve()
    for name in paths:
        data = Path(name).expanduser().resolve()
        if data.is_dir() and folder.is_relative_to(data):
            if not any(part.startswith(".") for part in folder.relative_to(data).parts):
                raise DataError(
                    f"the token cache {folder} is inside the data folder {name}, which would "
                    "read its entries as data",
                    f"give --cache-dir or {CACHE_ENV} a folder outside it (or a hidden one)",
                )


def _mirrored(root: Path, path: Path) -> Path:
    """The folder under `root` in the path of `path`'s folder ([Note: token cache])."""
    folder = path.parent.resolve()
    return root / folder.relative_to(folder.anchor)


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
    """Write a cache entry atomically ([Note: token cache]). A folder that cannot take it
    (read-only, full, not a folder) is a DataError naming the way to put the cache elsewhere,
    not an OSError from inside numpy."""
    array = ids if mask is None else np.stack([ids, mask.astype(ids.dtype)])
    try:
        _write_atomically(entry, array)
    except OSError as error:
        raise DataError(
            f"cannot write the token cache in {entry.parent} ({error.strerror or error})",
            f"give a writable folder with --cache-dir or {CACHE_ENV}",
        ) from None


def _write_atomically(entry: Path, array: np.ndarray) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
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

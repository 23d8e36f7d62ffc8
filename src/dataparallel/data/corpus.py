"""Text corpora as byte tokens: the built-in standard-library corpus or the user's own files.

The built-in corpus is the `.py` sources of the running interpreter's standard library (about
30 MB on CPython 3.11; `site-packages` excluded), so every machine has real text to train on
without a download. Its content differs between Python versions, which is why the run records
the corpus' hash.

[Note: corpus split] Documents are read in sorted order of their path (relative to the root
given), concatenated, and the *last* `val_fraction` of the bytes is the validation split. Both
are pure functions of the files' names and contents, so every rank and every run gets the same
split without communicating, and validation text is held out as whole stretches of files (for
the stdlib: the tail of the alphabet: xml, zipfile, zoneinfo...), never interleaved with training
text.

[Note: windows] A split of n tokens is cut into `(n - 1) // block` non-overlapping windows;
window i is tokens[i*block : i*block + block + 1], its input the first `block` tokens and its
targets the last `block` (the input shifted by one). Every target token belongs to exactly one
window, and every window has exactly `block` targets.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Folders of the stdlib tree that are not the standard library itself.
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__"}
# A file whose first bytes hold a NUL is taken for binary and skipped in --data folders.
_BINARY_PROBE = 8192


def stdlib_root() -> Path:
    """The folder of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Every `.py` file of the standard library, sorted by path relative to its root."""
    root = stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as handle:
        return b"\0" in handle.read(_BINARY_PROBE)


def user_files(paths: list[str], known: tuple[str, ...] = ()) -> list[Path]:
    """The text files named by `paths` (files, or folders searched recursively), in order.

    Inside a folder, hidden files and folders are skipped, and so are files that look binary
    (a NUL byte in their first 8 KiB) unless their name ends with one of the `known`
    suffixes (data formats, data/formats.py); files named directly are always taken. Raises
    FileNotFoundError / PermissionError / ValueError with the path at fault.
    """
    found: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_file():
            if not os.access(path, os.R_OK):
                raise PermissionError(f"{name} is not readable")
            found.append(path)
        elif path.is_dir():
            inside = []
            for folder, dirs, files in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                for f in files:
                    candidate = Path(folder, f)
                    if f.startswith(".") or not candidate.is_file():
                        continue
                    if not os.access(candidate, os.R_OK):
                        raise PermissionError(f"{candidate} is not readable")
                    if f.lower().endswith(known) or not _looks_binary(candidate):
                        inside.append(candidate)
            if not inside:
                raise ValueError(f"{name} holds no readable text file")
            found += sorted(inside, key=lambda p: p.relative_to(path).as_posix())
        elif path.exists():
            raise ValueError(f"{name} is neither a file nor a folder")
        else:
            raise FileNotFoundError(f"{name} does not exist")
    return found


def corpus_files(paths: list[str] | None) -> list[Path]:
    """The files of the corpus: the user's `paths`, or the built-in stdlib corpus when empty."""
    return user_files(paths) if paths else stdlib_files()


def corpus_size(files: list[Path]) -> int:
    """Total bytes (= tokens) of `files`, from their sizes alone (cheap; no reading)."""
    return sum(f.stat().st_size for f in files)


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A corpus read into memory as byte tokens.

    tokens: every byte of every file, concatenated in order (uint8, one token per byte).
    num_files: how many files it was read from.
    sha256: hash of the files' names (relative to their root) and contents, in order; two
        runs with the same hash trained on the same text.
    source: where it came from, for the report ("stdlib:<root>" or the user's paths).
    """

    tokens: torch.Tensor
    num_files: int
    sha256: str
    source: str

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def target_tokens(self) -> int:
        """Tokens the loss counts: all of them, for text."""
        return len(self.tokens)

    def split(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(train, validation) token streams; see [Note: corpus split]."""
        return split_tokens(self.tokens, val_fraction)


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 1 - val_fraction of `tokens` for training, the rest for validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


def load_corpus(paths: list[str] | None = None) -> Corpus:
    """Read the corpus (the user's `paths`, or the stdlib when empty) as byte tokens."""
    files = corpus_files(paths)
    root = stdlib_root() if not paths else None
    digest = hashlib.sha256()
    chunks = []
    for f in files:
        data = f.read_bytes()
        # The name goes into the hash too (relative, so the install prefix does not matter).
        name = f.relative_to(root).as_posix() if root else f.name
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        digest.update(data)
        chunks.append(data)
    blob = b"".join(chunks)
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0)
    source = f"stdlib:{root}" if root else ", ".join(paths)
    return Corpus(tokens=tokens, num_files=len(files), sha256=digest.hexdigest(), source=source)


def num_windows(num_tokens: int, block: int) -> int:
    """How many windows of `block` targets a stream of `num_tokens` tokens gives."""
    return max(0, (num_tokens - 1) // block)


class TokenWindows:
    """The windows of one token stream (see [Note: windows]); index like a dataset."""

    def __init__(self, tokens: torch.Tensor, block: int):
        if block < 1:
            raise ValueError(f"block={block} must be >= 1")
        self.tokens = tokens
        self.block = block
        self.offsets = torch.arange(block + 1)

    def __len__(self) -> int:
        return num_windows(len(self.tokens), self.block)

    def batch(self, indices: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(indices), block) int64, for the windows `indices`."""
        starts = torch.as_tensor(indices, dtype=torch.long) * self.block
        rows = self.tokens[starts[:, None] + self.offsets].long()
        return rows[:, :-1], rows[:, 1:]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([index])
        return x[0], y[0]


def evenly_spaced(count: int, total: int) -> list[int]:
    """`count` indices spread evenly over range(total) (all of them when count is 0 or more)."""
    if count <= 0 or count >= total:
        return list(range(total))
    return [(i * total) // count for i in range(count)]

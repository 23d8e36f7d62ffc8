"""The pieces tokenization is shared out in: whole files, and large text/JSONL files in chunks.

[Note: chunks] A text or JSONL file larger than CHUNK_BYTES (32 MiB) that needs tokenizing is
cut into pieces of about CHUNK_BYTES, each ending at a line end, so that one large file is
still tokenized by every rank. Each piece is a cache entry of its own, keyed by a hash of its
place in the file and its bytes; the cut depends on the file alone (never on the number of
ranks), so every run finds the same entries. A JSONL chunk's records keep their line numbers in
errors, and its kind is the kind of the file's first record. Text is one document per file:
its pieces are tokenized separately (a token may split differently at a cut, which is always a
line end) and only the last one is followed by the end-of-text id. Parquet and token files are
never cut.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .cache import content_sha256
from .formats import JSONL, TEXT

CHUNK_BYTES = 32 << 20
_READ = 1 << 22


@dataclass(frozen=True)
class Unit:
    """One piece of tokenization work.

    path: the file.
    fmt: its format (data/formats.py).
    start: the piece's first byte.
    end: one past its last byte.
    whole: whether the piece is the whole file.
    """

    path: Path
    fmt: str
    start: int
    end: int
    whole: bool

    @property
    def last(self) -> bool:
        """Whether the piece ends the file."""
        return self.end == self.path.stat().st_size

    def read(self) -> bytes:
        with open(self.path, "rb") as handle:
            handle.seek(self.start)
            return handle.read(self.end - self.start)

    def sha256(self) -> str:
        """The file's content hash for a whole file; else a hash of the bounds and the bytes."""
        if self.whole:
            return content_sha256(self.path)
        digest = hashlib.sha256(f"{self.start}-{self.end}\0".encode())
        digest.update(self.read())
        return digest.hexdigest()

    def first_line(self) -> int:
        """The line number (from 1) of the piece's first line in the file."""
        lines, done = 1, 0
        with open(self.path, "rb") as handle:
            while done < self.start:
                block = handle.read(min(_READ, self.start - done))
                lines += block.count(b"\n")
                done += len(block)
        return lines


def plan_units(files: list[tuple[Path, str]], chunked, chunk_bytes: int | None = None) -> list:
    """The units of `files` in stream order; `chunked(fmt)` says whether a format may be cut
    (pieces of chunk_bytes, default CHUNK_BYTES)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    units = []
    for path, fmt in files:
        size = path.stat().st_size
        if fmt in (TEXT, JSONL) and chunked(fmt) and size > chunk_bytes:
            bounds = line_cuts(path, size, chunk_bytes)
            units += [
                Unit(path, fmt, a, b, False) for a, b in zip(bounds, bounds[1:], strict=False)
            ]
        else:
            units.append(Unit(path, fmt, 0, size, True))
    return units


def line_cuts(path: Path, size: int, chunk_bytes: int) -> list[int]:
    """0, the first line start at or after each multiple of chunk_bytes, and `size`."""
    cuts = [0]
    with open(path, "rb") as handle:
        for target in range(chunk_bytes, size, chunk_bytes):
            if target <= cuts[-1]:
                continue
            handle.seek(target - 1)
            while True:  # find the end of the line that holds byte target - 1
                block = handle.read(_READ)
                if not block:
                    break
                newline = block.find(b"\n")
                if newline >= 0:
                    cut = handle.tell() - len(block) + newline + 1
                    if cut < size:
                        cuts.append(cut)
                    break
    return cuts + [size]


def owners(units: list[Unit], ranks: int) -> list[int]:
    """The rank that tokenizes each unit: largest first, to the least loaded rank."""
    result = [0] * len(units)
    load = [0] * ranks
    for i in sorted(range(len(units)), key=lambda i: (units[i].start - units[i].end, i)):
        result[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[result[i]] += units[i].end - units[i].start
    return result

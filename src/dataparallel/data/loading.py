"""The one way the trainer gets its data: `load_datasets(paths, tokenizer, ...)`.

    train, val, info = load_datasets(["chats.jsonl"], HFTokenizer.load(dir), block=256,
                                     val_fraction=0.05, world=world)

Text read by the byte tokenizer is read as it always was (load_corpus: its bytes are its
tokens, nothing cached). Everything else is tokenized once and cached ([Note: token cache] in
cache.py), packed ([Note: packing] in packing.py) and cut into windows.

[Note: parallel tokenization] The files, and the chunks of large text/JSONL files ([Note:
chunks] in units.py), are shared among the ranks, largest first, each to the rank with the
least bytes so far; rank r hashes its pieces, tokenizes those with no cache entry and writes
the entries. The ranks then meet in one all-gather (of plain values, comm/plain.py) that
carries each piece's hash and any error, so that a bad file stops every rank together with the
same one-line message (DataError) instead of leaving the others waiting. Then every rank memory-maps every entry; a
rank that cannot find one (nodes with no shared file system) tokenizes that piece itself, and
rank 0 removes the entries of older versions of the files. Without a process group (world None
or of size 1) the one process does it all. The meeting is an ordinary collective, under the
process group's timeout (10 minutes): tokenize a larger data set once beforehand with one
process (`load_datasets` with world=None).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import cache
from .corpus import TokenWindows, corpus_files, load_corpus, stdlib_root, user_files
from .formats import JSONL, PARQUET, TEXT, TOKENS, DataError, documents, file_format
from .packing import PackedWindows, TokenStream, pack_documents
from .tokens import check_ids, open_token_file
from .units import Unit, owners, plan_units

CHECKED_RECORDS = 100  # records of each JSONL/Parquet file the preflight check renders


@dataclass(frozen=True, kw_only=True)
class DataInfo:
    """What a run trained on, for its records (run.json, the header, the checkpoints).

    source: where it came from ("stdlib:<root>" or the paths given).
    num_files: files read.
    sha256: for text read as bytes, the hash of the files' names and contents (as load_corpus
        computes it); otherwise the hash of each file's (or chunk's) name, bounds and content
        hash, in order.
    num_tokens: tokens of the packed stream, both splits.
    target_tokens: of those, the ones the loss counts ([Note: loss masking]).
    formats: the formats read, sorted ("jsonl", "parquet", "text", "tokens").
    tokenizer: the fingerprint of the tokenizer that made the tokens (data/tokenizer.py).
    """

    source: str
    num_files: int
    sha256: str
    num_tokens: int
    target_tokens: int
    formats: tuple[str, ...]
    tokenizer: str


def data_files(paths: list[str] | None) -> list[tuple[Path, str]]:
    """(file, format) of every file `paths` names, in order ([Note: corpus split])."""
    cache.check_outside(paths or [])
    files = user_files(paths, known=_KNOWN) if paths else corpus_files(None)
    return [(f, file_format(f)) for f in files]


_KNOWN = (".jsonl", ".parquet", ".bin", ".npy")  # taken from folders although they look binary


def reads_bytes(files: list[tuple[Path, str]], tokenizer) -> bool:
    """Whether the data is text read as byte tokens (load_corpus' path, nothing to cache)."""
    return tokenizer.fingerprint == "bytes-v1" and all(fmt == TEXT for _, fmt in files)


def load_datasets(
    paths: list[str] | None,
    tokenizer,
    block: int,
    val_fraction: float,
    *,
    world=None,
    token_dtype: str = "auto",
) -> tuple[TokenWindows | PackedWindows, TokenWindows | PackedWindows, DataInfo]:
    """(train windows, validation windows, info) of the data `paths` names (empty: the built-in
    corpus), tokenized by `tokenizer`. Raises DataError (one line) for bad data, and when a
    split holds too few windows (training: one per rank; validation: one)."""
    files = data_files(paths)
    if reads_bytes(files, tokenizer):
        corpus = load_corpus(paths)
        train_tokens, val_tokens = corpus.split(val_fraction)
        train, val = TokenWindows(train_tokens, block), TokenWindows(val_tokens, block)
        formats, total = (TEXT,), len(corpus.tokens)
        info = DataInfo(
            source=corpus.source,
            num_files=corpus.num_files,
            sha256=corpus.sha256,
            num_tokens=total,
            target_tokens=total,
            formats=formats,
            tokenizer=tokenizer.fingerprint,
        )
    else:
        units, hashes, parts = tokenize_units(files, tokenizer, world, token_dtype)
        stream = TokenStream(parts)
        total = len(stream)
        cut = total - int(total * val_fraction)  # [Note: corpus split]
        train = PackedWindows(stream, 0, cut, block)
        val = PackedWindows(stream, cut, total, block)
        digest = hashlib.sha256()
        for unit, sha in zip(units, hashes, strict=True):
            digest.update(f"{unit.path.name}\0{unit.start}\0{unit.end}\0{sha}\n".encode())
        info = DataInfo(
            source=", ".join(paths) if paths else f"stdlib:{stdlib_root()}",
            num_files=len(files),
            sha256=digest.hexdigest(),
            num_tokens=int(total),
            target_tokens=int(stream.num_targets(0, total)),
            formats=tuple(sorted({fmt for _, fmt in files})),
            tokenizer=tokenizer.fingerprint,
        )
    ranks = world.world_size if world is not None else 1
    if len(train) < ranks or len(val) < 1:
        raise DataError(
            f"{info.num_tokens} tokens give {len(train)} training and {len(val)} validation "
            f"windows of {block} tokens, for {ranks} ranks",
            "give more data, a smaller --block-size, fewer workers or another --val-fraction",
        )
    return train, val, info


def load_windows(
    paths: list[str], tokenizer, block: int, *, world=None, token_dtype: str = "auto"
) -> TokenWindows | PackedWindows:
    """The windows of `block` targets of the whole data `paths` names (no split), every format
    `load_datasets` reads, tokenized once and cached the same way (`dataparallel eval`)."""
    files = data_files(paths)
    if reads_bytes(files, tokenizer):
        return TokenWindows(load_corpus(paths).tokens, block)
    _, _, parts = tokenize_units(files, tokenizer, world, token_dtype)
    stream = TokenStream(parts)
    return PackedWindows(stream, 0, len(stream), block)


def tokenize_units(files, tokenizer, world, token_dtype: str):
    """(units, their hashes, their (ids, mask) parts) of `files`, tokenized in parallel and
    cached ([Note: parallel tokenization], [Note: chunks] in units.py)."""
    rank, ranks = (world.rank, world.world_size) if world is not None else (0, 1)
    units = plan_units(files, lambda fmt: _cached(fmt, tokenizer))
    found: dict[int, str] = {}
    error = None
    try:
        for i, owner in enumerate(owners(units, ranks)):
            if owner == rank:
                found[i] = _prepare(units[i], tokenizer, token_dtype)
    except DataError as failure:
        error = (failure.problem, failure.fix)
    except (OSError, ValueError) as failure:
        error = (str(failure), "check the file")
    if ranks > 1:
        from ..comm.plain import all_gather_plain

        everyone = all_gather_plain((found, error), group=world.group)  # never a pickle
    else:
        everyone = [(found, error)]
    for theirs, failure in everyone:
        if failure is not None:
            raise DataError(*failure)
        found.update(theirs)
    hashes = [found[i] for i in range(len(units))]
    parts = [_part(u, tokenizer, sha, token_dtype) for u, sha in zip(units, hashes, strict=True)]
    if rank == 0:
        cache.prune({_entry(u, tokenizer, sha) for u, sha in zip(units, hashes, strict=True)})
    return units, hashes, parts


def _prepare(unit: Unit, tokenizer, token_dtype: str) -> str:
    """Hash a unit, check it (token files) or tokenize it into the cache; return the hash."""
    sha = unit.sha256()
    if unit.fmt == TOKENS:
        ids = open_token_file(unit.path, token_dtype, tokenizer.vocab_size)
        check_ids(ids, tokenizer.vocab_size, unit.path)
    elif _cached(unit.fmt, tokenizer):
        entry = _entry(unit, tokenizer, sha)
        if cache.read_entry(entry) is None:
            cache.write_entry(entry, *tokenize_unit(unit, tokenizer))
    return sha


def _cached(fmt: str, tokenizer) -> bool:
    """Token files are read as they are; so is text for the byte tokenizer (its bytes)."""
    return fmt != TOKENS and not (fmt == TEXT and tokenizer.fingerprint == "bytes-v1")


def _entry(unit: Unit, tokenizer, sha: str) -> Path:
    return cache.entry_path(unit.path, tokenizer.fingerprint, sha)


def _part(unit: Unit, tokenizer, sha: str, token_dtype: str):
    """A unit's (ids, mask or None), from its cache entry (written here if missing)."""
    if unit.fmt == TOKENS:
        return open_token_file(unit.path, token_dtype, tokenizer.vocab_size), None
    if not _cached(unit.fmt, tokenizer):
        return np.fromfile(unit.path, dtype=np.uint8), None
    entry = _entry(unit, tokenizer, sha)
    part = cache.read_entry(entry)
    if part is None:  # another node's rank tokenized it, on a disk this node does not share
        cache.write_entry(entry, *tokenize_unit(unit, tokenizer))
        part = cache.read_entry(entry)
    return part


def tokenize_unit(unit: Unit, tokenizer) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokenize a text, JSONL or Parquet file or chunk: (ids, mask or None) ([Note: packing])."""
    if unit.fmt == TEXT:
        text = unit.read().decode("utf-8", errors="replace")
        return pack_documents([[(text, True)]], tokenizer, eos=unit.last)
    span = None if unit.whole else (unit.start, unit.end, unit.first_line())
    return pack_documents(
        documents(unit.path, unit.fmt, _chat(tokenizer, unit.path), span=span), tokenizer
    )


def _chat(tokenizer, path: Path):
    def render(messages: list[dict]):
        if not tokenizer.has_chat_template:
            raise DataError(
                f"{path} holds chat messages but the tokenizer has no chat template",
                "use a model whose tokenizer has one, or give prompt/completion records",
            )
        try:
            return tokenizer.render_chat(messages)
        except ValueError as error:
            raise DataError(f"{path}: {error}", "use a standard chat template") from None
        except Exception as error:  # noqa: BLE001 - the template's own error (jinja2)
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise DataError(
                f"{path}: the chat template failed on a conversation ({first})",
                "check the messages' roles and order against the model's template",
            ) from None

    return render


def check_sources(paths: list[str] | None, tokenizer, *, token_dtype: str = "auto") -> list:
    """The checks before a run (checks.py), reading only: the files exist, each format opens,
    token files hold only ids of the vocabulary, and every JSONL/Parquet record has its fields
    (chat: a template, which renders the first CHECKED_RECORDS records of each file) unless the
    file (or chunk) has a cache entry already, whose records were checked when it was written.
    Returns data_files(paths); raises DataError or OSError."""
    files = data_files(paths)
    for unit in plan_units(files, lambda fmt: _cached(fmt, tokenizer)):
        path, fmt = unit.path, unit.fmt
        if fmt == TOKENS:
            check_ids(
                open_token_file(path, token_dtype, tokenizer.vocab_size), tokenizer.vocab_size, path
            )
        elif fmt in (JSONL, PARQUET):
            if unit.start == 0:  # the first records, rendered
                for _ in documents(path, fmt, _chat(tokenizer, path), limit=CHECKED_RECORDS):
                    pass
            if cache.entry_path(path, tokenizer.fingerprint, unit.sha256()).is_file():
                continue
            span = None if unit.whole else (unit.start, unit.end, unit.first_line())
            for _ in documents(path, fmt, _fields_only(tokenizer, path), span=span):
                pass
    return files


def _fields_only(tokenizer, path: Path):
    """A chat renderer for checking: a template must exist; nothing is rendered."""
    render = _chat(tokenizer, path)

    def check(messages: list[dict]):
        return [] if tokenizer.has_chat_template else render(messages)

    return check

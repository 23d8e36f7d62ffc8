"""The formats `--data` reads, told apart by the file's extension, and their documents.

    .jsonl            one JSON object per line: {"text"}, {"prompt", "completion"} or {"messages"}
    .parquet          the same fields as columns (read with pyarrow)
    .bin / .npy       token ids already tokenized (tokens.py); memory-mapped, never cached
    anything else     text: the whole file is one document

A document is a list of (text, is_target) segments: a text document is one target segment; a
prompt/completion pair is the prompt (not a target) then the completion (a target); a chat is
what the tokenizer's chat template renders, the assistant's replies the targets
([Note: loss masking] in packing.py). The first non-empty line (or the columns) of a file
decides its kind, and every line must then have the same fields: a mistake is reported with the
file, the line and the field expected.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

TEXT, JSONL, PARQUET, TOKENS = "text", "jsonl", "parquet", "tokens"
TOKEN_SUFFIXES = (".bin", ".npy")
# The kinds of record a JSONL line or a Parquet row holds, by the fields that mark them.
KINDS = {"text": ("text",), "prompt/completion": ("prompt", "completion"), "chat": ("messages",)}
Segments = list[tuple[str, bool]]


class DataError(ValueError):
    """Bad data, reported on one line as `<problem>; <fix>` (the CLI exits 2 with it)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


def file_format(path: Path) -> str:
    """Which format a file is read as, from its extension."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JSONL
    if suffix == ".parquet":
        return PARQUET
    if suffix in TOKEN_SUFFIXES:
        return TOKENS
    return TEXT


def record_kind(fields, where: str) -> str:
    """The kind of record ("text", "prompt/completion" or "chat") that `fields` name."""
    for kind, needed in KINDS.items():
        if all(name in fields for name in needed):
            return kind
    if "prompt" in fields:
        raise DataError(f'{where} has "prompt" but no "completion" field', _FIX)
    raise DataError(f'{where} has no "text", "prompt"/"completion" or "messages" field', _FIX)


_FIX = 'give each record a "text" string, a "prompt" and a "completion", or chat "messages"'


def segments_of(record: dict, kind: str, where: str, chat) -> Segments:
    """The (text, is_target) segments of one record; `chat(messages)` renders a conversation."""
    for name in KINDS[kind]:
        if name not in record:
            raise DataError(
                f'{where} has no "{name}" field (the first record of the file is {kind})',
                f'give every record of the file a "{name}", as the first one has',
            )
    if kind == "text":
        return [(_string(record, "text", where), True)]
    if kind == "prompt/completion":
        prompt, completion = _string(record, "prompt", where), _string(record, "completion", where)
        return [(prompt, False), (completion, True)]
    messages = record["messages"]
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise DataError(
            f'{where}: "messages" is not a list of {{"role", "content"}} strings',
            'write "messages": [{"role": "user", "content": "..."}, ...]',
        )
    return chat(messages)


def _string(record: dict, name: str, where: str) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise DataError(
            f'{where}: "{name}" is {type(value).__name__}, not a string', f'make "{name}" a string'
        )
    return value


def jsonl_records(
    path: Path, limit: int | None = None, span: tuple[int, int, int] | None = None
) -> Iterator[tuple[dict, str]]:
    """(record, "FILE line N") for each non-empty line of a JSONL file (the first `limit`);
    span: (first byte, end byte, number of the first line) to read a chunk ([Note: chunks])."""
    start, end, first = span or (0, None, 1)
    seen, position = 0, start
    with open(path, "rb") as handle:
        handle.seek(start)
        for number, raw in enumerate(handle, start=first):
            if end is not None and position >= end:
                return
            position += len(raw)
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where} is not UTF-8", "write the file in UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where} is not JSON ({error.msg})", "write one object a line"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{where} is not a JSON object", "write one object a line")
            yield record, where
            seen += 1
            if limit is not None and seen >= limit:
                return


def parquet_records(path: Path, limit: int | None = None) -> Iterator[tuple[dict, str]]:
    """(record, "FILE row N") for each row of a Parquet file (the first `limit`)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path} is Parquet, which needs pyarrow", 'pip install "dataparallel[hf]"'
        ) from None
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DataError(
            f"{path} is not a readable Parquet file ({error})", "write it with pyarrow or pandas"
        ) from None
    kind = record_kind(table.schema_arrow.names, f"{path} (columns)")
    row = 0
    for batch in table.iter_batches(columns=list(KINDS[kind]), batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            for name, value in record.items():
                if value is None:
                    raise DataError(f"{path} row {row}: {name!r} is null", f"fill in {name!r}")
            yield record, f"{path} row {row}"
            if limit is not None and row >= limit:
                return


def documents(
    path: Path, fmt: str, chat, limit: int | None = None, span: tuple[int, int, int] | None = None
) -> Iterator[Segments]:
    """The documents of a JSONL or Parquet file (or of a JSONL chunk: `span` as in
    jsonl_records), checked record by record."""
    kind = None
    if span is not None and span[0] > 0:  # a chunk is of the kind of the file's first record
        for record, where in jsonl_records(path, limit=1):
            kind = record_kind(record, where)
    records = jsonl_records(path, limit, span) if fmt == JSONL else parquet_records(path, limit)
    for record, where in records:
        if kind is None:
            kind = record_kind(record, where)
        yield segments_of(record, kind, where, chat)

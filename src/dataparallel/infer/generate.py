"""`dataparallel generate`: completions of a JSONL file of prompts, across ranks, in input order.

Rank r takes a consecutive share of the prompts (shares differ by one at most, so any count
works), sorts it by length and cuts it into batches of `batch` prompts (for the built-in GPTs,
of one length: they take no padding mask). Each batch runs exactly `tokens` forwards, and a
rank with fewer batches than the busiest runs stand-in batches, so that a ZeRO-3 model's
forwards stay in step on every rank ([Note: forwards in step] in decoding.py). Rank 0 gathers
every completion and writes one line per prompt, in the order of the input: the input's
fields and `completion`.

Greedy completions do not depend on the number of ranks nor on the batch a prompt lands in,
up to the last bits of the float sums (a batch of other lengths pads differently); sampled
ones draw from a generator per prompt ([Note: forwards in step]).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import dataparallel as dp

from ..launch.config import ConfigError
from .decoding import Sampling, decode
from .model_loading import LoadedModel
from .ranks import contiguous_share, gather_objects, reduce_numbers


@dataclass(frozen=True, kw_only=True)
class GenerateJob:
    """One `dataparallel generate`.

    prompts: the JSONL file, one object with a "prompt" string a line.
    out: the JSONL file written (by rank 0).
    tokens: new tokens per prompt (fewer when the model emits its stop token).
    batch: prompts per forward on each rank.
    sampling: greedy, or temperature / top-k sampling.
    """

    prompts: str
    out: str
    tokens: int = 64
    batch: int = 8
    sampling: Sampling = Sampling()


def read_prompts(path: str | Path) -> list[dict]:
    """The records of a JSONL prompts file (checked by command.py before any worker starts)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plan_batches(lengths: dict[int, int], batch: int, same_length: bool) -> list[list[int]]:
    """Batches of prompt indices: sorted by length (then index), `batch` at most each; with
    `same_length`, no batch mixes lengths."""
    ordered = sorted(lengths, key=lambda i: (lengths[i], i))
    groups = (
        [list(g) for _, g in groupby(ordered, key=lambda i: lengths[i])]
        if same_length
        else [ordered]
    )
    return [group[k : k + batch] for group in groups for k in range(0, len(group), batch)]


def generate(world: dp.World, loaded: LoadedModel, job: GenerateJob) -> list[str] | None:
    """This rank's part of `job`; on rank 0, every completion in input order (else None).

    Rank 0 also writes `job.out`.
    """
    records = read_prompts(job.prompts)
    tokenizer = loaded.tokenizer
    mine = contiguous_share(len(records), world)
    encoded = {i: tokenizer.encode(records[i]["prompt"]) for i in mine}
    batches = plan_batches(
        {i: len(ids) for i, ids in encoded.items()}, job.batch, loaded.kind == "gpt"
    )
    longest = max((len(ids) for ids in encoded.values()), default=0)
    most, longest = reduce_numbers([len(batches), longest], world, op="max", what="batches")
    check_context(loaded, int(longest), job.tokens)  # on every rank alike
    stand_in = encoded[mine[0]] if len(mine) else [loaded.pad_id]
    completions: dict[int, list[int]] = {}
    for k in range(int(most)):
        if k < len(batches):
            indices = batches[k]
            new = decode(loaded, [encoded[i] for i in indices], indices, job.tokens, job.sampling)
            completions.update(zip(indices, new, strict=True))
        else:  # [Note: forwards in step]: the same forwards as the busiest rank
            decode(loaded, [stand_in], [0], job.tokens, job.sampling)
    everyone = gather_objects(completions, world, what="completions")
    if not world.is_main:
        return None
    merged = {i: ids for part in everyone for i, ids in part.items()}
    texts = [tokenizer.decode(merged[i]) for i in range(len(records))]
    write_jsonl(job.out, [{**r, "completion": t} for r, t in zip(records, texts, strict=True)])
    return texts


def check_context(loaded: LoadedModel, longest: int, tokens: int) -> None:
    """A ConfigError when the longest prompt and its new tokens exceed an HF model's positions
    (a built-in GPT slides its window instead, as `sample` does)."""
    if loaded.kind == "hf" and loaded.context and longest + tokens > loaded.context:
        raise ConfigError(
            "--tokens",
            f"the longest prompt ({longest} tokens) and {tokens} new tokens exceed the model's "
            f"{loaded.context} positions",
            f"use at most {max(loaded.context - longest, 0)} or shorten the prompts",
        )


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """Write `records` one JSON object a line, whole or not at all (a temporary file renamed)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(partial, path)

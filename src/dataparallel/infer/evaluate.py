"""`dataparallel eval`: the exact perplexity of a dataset under a model, across ranks.

The data's token stream is cut into windows of `block` targets ([Note: windows] in
data/corpus.py): every target token after the first of the stream belongs to exactly one
window. Rank r scores windows r, r + K, ... and sums the cross-entropy of each of their target
tokens in float64; one all-reduce of (sum, count) gives the mean over every target token, so
the figure does not depend on K (up to float64 rounding of the sums). As in generate, every
rank runs the same number of forwards ([Note: forwards in step] in decoding.py): a rank whose
share has run out scores a stand-in window and drops it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

import dataparallel as dp

from ..data.formats import DataError
from ..data.loading import load_windows
from ..data.packing import IGNORE
from ..launch.config import ConfigError
from .model_loading import LoadedModel, logits
from .ranks import reduce_numbers, strided_share


@dataclass(frozen=True, kw_only=True)
class EvalJob:
    """One `dataparallel eval`.

    paths: the data (text files or folders, as `dataparallel train --data` takes).
    block: target tokens per window; 0: the model's context (at most 1024).
    batch: windows per forward on each rank.
    out: a JSON file for the result (rank 0 writes it); empty: none.
    """

    paths: tuple[str, ...]
    block: int = 0
    batch: int = 8
    out: str = ""


@dataclass(frozen=True)
class Perplexity:
    """loss: mean cross-entropy per target token (nats); perplexity: exp(loss); tokens: how many
    target tokens were scored; windows: in how many windows."""

    loss: float
    perplexity: float
    tokens: int
    windows: int


def token_windows(paths: tuple[str, ...], tokenizer, block: int, world=None):
    """The windows of `block` targets of the data at `paths`, tokenized with `tokenizer`: every
    format `dataparallel train --data` reads, through the same cache (data/loading.py)."""
    try:
        return load_windows(list(paths), tokenizer, block, world=world)
    except DataError as error:  # its own fix (the cache's: --cache-dir)
        raise ConfigError("--data", error.problem, error.fix) from None
    except (OSError, ValueError) as error:
        raise ConfigError(
            "--data", str(error), "give text, JSONL, Parquet or token files"
        ) from None


def window_size(loaded: LoadedModel, block: int) -> int:
    """The block asked for, or the model's context (capped at 1024)."""
    return block or min(loaded.context or 1024, 1024)


@torch.no_grad()
def evaluate(world: dp.World, loaded: LoadedModel, job: EvalJob) -> Perplexity:
    """The perplexity of `job`'s data, the same on every rank."""
    windows = token_windows(job.paths, loaded.tokenizer, window_size(loaded, job.block), world)
    mine = list(strided_share(len(windows), world))
    longest = -(-len(windows) // world.world_size)
    loss_sum, tokens = 0.0, 0
    for first in range(0, longest, job.batch):
        part = mine[first : first + job.batch]
        inputs, targets = windows.batch(part or [0])  # [Note: forwards in step]
        scores = logits(loaded, inputs.to(_device(loaded))).float()
        losses = F.cross_entropy(
            scores.flatten(0, 1),
            targets.flatten().to(scores.device),
            ignore_index=IGNORE,  # prompt tokens of prompt/completion and chat data
            reduction="none",
        )
        if part:
            loss_sum += float(losses.double().sum())
            tokens += int((targets != IGNORE).sum())
    total, count = reduce_numbers([loss_sum, tokens], world, what="eval sums")
    loss = total / max(count, 1)
    return Perplexity(loss=loss, perplexity=math.exp(loss), tokens=int(count), windows=len(windows))


def _device(loaded: LoadedModel) -> torch.device:
    return next(loaded.model.parameters()).device

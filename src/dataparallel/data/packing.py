"""Documents packed into one token stream, and the stream cut into training windows.

[Note: packing] Each file's documents are tokenized in order and each document is followed by
the tokenizer's `eos_id` (nothing when it is None, as for the byte tokenizer); the files follow
each other in the order `--data` lists them (folders in sorted path order). The stream is cut
into windows exactly as a text corpus is ([Note: windows] in corpus.py): window i is stream
positions [i*block, i*block + block + 1), across document and file boundaries, and the last
val_fraction of the stream is the validation split ([Note: corpus split]). Everything is a
pure function of the files and the tokenizer, so every rank and every resumed run sees the same
windows, and the sample stream's global position ([Note: global sample position]) keeps its
meaning.

[Note: loss masking] Every token carries a mask bit: 1 when it is a target the loss counts.
Text is all targets. For prompt/completion data only the completion is, and for chat data only
the assistant's replies (with the template's end-of-turn text); the eos after a document is a
target when the document's last token is (the model learns where an answer ends). A window's
targets at masked positions are IGNORE (-100), which `F.cross_entropy(ignore_index=-100)`
skips and the trainer's token count leaves out ([Note: loss normalisation] in trainer.py).
The inputs keep every token: the prompt is context, only not a target.
"""

from __future__ import annotations

import numpy as np
import torch

from .corpus import num_windows

IGNORE = -100  # the target of a position the loss does not count ([Note: loss masking])


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def pack_documents(
    documents, tokenizer, group: int = 1024, *, eos: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokenize `documents` (lists of (text, is_target) segments) into one stream of ids and
    its mask ([Note: packing]); the mask is None when every token is a target. Documents go to
    the tokenizer `group` at a time (`encode_batch`: a fast tokenizer runs a batch on threads)
    and the ids are kept as arrays, so memory stays near the 2-4 bytes an id costs. eos=False
    leaves out the end-of-text ids (a text file's pieces but the last, [Note: chunks])."""
    dtype = id_dtype(tokenizer.vocab_size)
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    batch: list = []
    for document in documents:
        batch.append(document)
        if len(batch) == group:
            _pack_group(batch, tokenizer, dtype, ids, mask, eos)
            batch = []
    _pack_group(batch, tokenizer, dtype, ids, mask, eos)
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)
    all_mask = np.concatenate(mask) if mask else np.zeros(0, dtype=bool)
    return all_ids, (None if all_mask.all() else all_mask)


def _pack_group(documents, tokenizer, dtype, ids: list, mask: list, with_eos: bool) -> None:
    texts = [text for segments in documents for text, _ in segments]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    eos = tokenizer.eos_id if with_eos else None
    for segments in documents:
        last = True
        for _, is_target in segments:
            part = next(encoded)
            ids.append(np.asarray(part, dtype=dtype))
            mask.append(np.full(len(part), is_target))
            last = is_target if part else last
        if eos is not None and segments:
            ids.append(np.asarray([eos], dtype=dtype))
            mask.append(np.asarray([last]))


class TokenStream:
    """Parts (one per file: ids, and a mask or None) read as one stream by position."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray | None]]):
        self.parts = [p for p in parts if len(p[0])]
        self.ends = np.cumsum([len(ids) for ids, _ in self.parts], dtype=np.int64)
        self.starts = self.ends - [len(ids) for ids, _ in self.parts]

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def take(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, mask bool) at `positions` (any shape)."""
        flat = positions.reshape(-1)
        ids = np.empty(flat.shape, dtype=np.int64)
        mask = np.ones(flat.shape, dtype=bool)
        which = np.searchsorted(self.ends, flat, side="right")
        for part in np.unique(which):
            here = which == part
            local = flat[here] - self.starts[part]
            part_ids, part_mask = self.parts[part]
            ids[here] = part_ids[local]
            if part_mask is not None:
                mask[here] = part_mask[local]
        return ids.reshape(positions.shape), mask.reshape(positions.shape)

    def num_targets(self, begin: int, end: int) -> int:
        """How many tokens in positions [begin, end) are targets."""
        total = 0
        for (ids, mask), start in zip(self.parts, self.starts, strict=True):
            lo, hi = max(begin - start, 0), min(end - start, len(ids))
            if hi > lo:
                total += int(np.count_nonzero(mask[lo:hi])) if mask is not None else hi - lo
        return total


class PackedWindows:
    """The windows of positions [begin, end) of a TokenStream; the interface of TokenWindows
    (`len`, `batch(indices) -> (inputs, targets)`), with masked targets set to IGNORE."""

    def __init__(self, stream: TokenStream, begin: int, end: int, block: int):
        if block < 1:
            raise ValueError(f"block={block} must be >= 1")
        self.stream, self.begin, self.end, self.block = stream, begin, end, block
        self.offsets = np.arange(block + 1, dtype=np.int64)

    def __len__(self) -> int:
        return num_windows(self.end - self.begin, self.block)

    def batch(self, indices: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(indices), block) int64, for the windows `indices`."""
        starts = self.begin + np.asarray(indices, dtype=np.int64) * self.block
        ids, mask = self.stream.take(starts[:, None] + self.offsets)
        targets = np.where(mask[:, 1:], ids[:, 1:], IGNORE)
        return torch.from_numpy(ids[:, :-1].copy()), torch.from_numpy(targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([index])
        return x[0], y[0]

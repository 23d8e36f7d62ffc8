"""What a rank holds, as a reader of its state sees it: the public side of [Note: geometry].

`dp.geometry(model, optimizer)` gives the runs this rank holds (`pieces`); these three calls
say what a sharded checkpoint needs besides, so that it reads only the public API, never the
strategies' parts:

    whole_shape(tensor)          the shape of the whole tensor a parameter is part of
    placement(piece)             where a piece's run lies in its whole flattened tensor
    state_kind(key, value, piece)  "elementwise" or "scalar" optimizer state, else None
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .strategies import SCALAR_STATE_KEYS, elementwise, tensor_parallel_of, whole_shape

__all__ = ["Placement", "placement", "state_kind", "whole_shape"]


@dataclass(frozen=True)
class Placement:
    """Where a piece's run (`piece.value`, flattened) lies in its whole flattened tensor.

    offset: where the run starts in the whole (0 when `runs` says).
    numel: elements of the whole tensor.
    runs: for a tensor-parallel parameter, whose local tensor is not one run of the whole:
        (position in the run, offset in the whole, length) per part; None: one run at
        `offset`.
    shape: the whole tensor's shape (`numel` elements).
    """

    offset: int
    numel: int
    runs: tuple[tuple[int, int, int], ...] | None = None
    shape: torch.Size | None = None


def placement(piece) -> Placement:
    """Where `piece` (a `dp.geometry(...).pieces` entry) lies in its whole parameter, a
    tensor-parallel one's DTensor included ([Note: tensor-parallel parameters])."""
    spec = tensor_parallel_of(piece.param)
    if spec is None:
        return Placement(piece.offset, piece.shape.numel(), shape=piece.shape)
    runs = spec.runs(piece.offset, piece.offset + piece.value.numel())
    return Placement(0, spec.shape.numel(), tuple(runs), torch.Size(spec.shape))


def state_kind(key: str, value, piece) -> str | None:
    """What the optimizer's state entry `key` of `piece` is ([Note: plain optimizer state]):
    "elementwise" (one number per element of the parameter, held as the piece is), "scalar"
    (one per parameter, e.g. Adam's `step`), or None (neither: a sharded state cannot hold
    it)."""
    if elementwise(key, value, piece.key):
        return "elementwise"
    if torch.is_tensor(value) and (value.dim() == 0 or key in SCALAR_STATE_KEYS):
        return "scalar"
    return None

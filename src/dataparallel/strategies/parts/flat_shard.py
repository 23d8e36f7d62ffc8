"""A flat shard: this rank's part of one flat buffer of parameters, as its optimizer sees it.

[Note: flat shard] Every sharded strategy builds its state from the same two things: a
`ShardLayout` ([Note: shard layout] in layout.py) and, per rank, a `FlatShard`. A ZeRO-1/2
bucket is one, a ZeRO-3 unit is one. The shard holds
- `data`: this rank's elements in the dtype the optimizer steps: fp32 master weights when the
  parameters are held in low precision, otherwise the parameters' own memory (a slice of the
  flat parameter buffer for ZeRO-1/2, the unit's shard for ZeRO-3);
- `pieces`: per parameter of the layout, an nn.Parameter viewing that parameter's part of
  `data`, or None where it has no element on this rank. The optimizer is the user's class built
  over the pieces, one tensor per piece, so param groups, per-parameter scalars (Adam's `step`)
  and LR schedulers keep their meaning, and an elementwise update is exactly the one-process
  update of that part of the parameter;
- the gradient: each synchronised backward hands the shard its reduced (averaged) gradient,
  which `take_reduced` keeps in a flat store of `data`'s dtype; at the end of the round
  `attach_grads` makes each piece's `.grad` a view into it. A plain optimizer, the global-norm
  clip and `torch.amp.GradScaler` therefore see ordinary gradients, and `zero_grad` clears them.

[Note: skipped parameters] In one process a parameter whose .grad is None is skipped by the
step: no weight decay, no momentum, no `step` count. A piece gets a .grad only if some rank used
its parameter since the last zero_grad, so the step skips the same parameters, exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from .layout import ShardLayout


@torch.no_grad()
def shard_values(layout: ShardLayout, rank: int, values: list[torch.Tensor], dtype, device):
    """`rank`'s slice of the flat buffer `values` (whole parameters, in layout order) would
    make, built from the pieces alone (the flat buffer is never materialised); padding zero."""
    data = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    for piece in layout.pieces(rank):
        part = values[piece.param].reshape(-1)[piece.start : piece.stop]
        data[piece.shard_start : piece.shard_start + piece.numel].copy_(part)
    return data


class FlatShard:
    """This rank's shard of one flat buffer ([Note: flat shard]).

    layout: how the flat buffer splits over the shard group.
    rank: this rank's index in the shard group.
    data: the shard's `layout.shard_numel` elements that the optimizer updates.
    trainable: per parameter of the layout, whether it requires a gradient (pieces of frozen
        parameters exist, for checkpoints, but are not given to the optimizer).
    """

    def __init__(self, layout: ShardLayout, rank: int, data: torch.Tensor, trainable: list[bool]):
        self.layout = layout
        self.rank = rank
        self.data = data
        # Per parameter: its [start, stop) in the shard, and where that part starts inside the
        # parameter ((0, 0) and 0 when it has no element here): the layout's pieces.
        self.ranges: list[tuple[int, int]] = [(0, 0)] * len(trainable)
        self.starts: list[int] = [0] * len(trainable)
        for piece in layout.pieces(rank):
            self.ranges[piece.param] = (piece.shard_start, piece.shard_start + piece.numel)
            self.starts[piece.param] = piece.start
        self.pieces: list[nn.Parameter | None] = []
        for (start, stop), requires_grad in zip(self.ranges, trainable, strict=True):
            piece = nn.Parameter(data[start:stop], requires_grad=requires_grad)
            self.pieces.append(piece if stop > start else None)
        # What the optimizer steps: the trainable pieces, in layout order.
        self.params = [p for p in self.pieces if p is not None and p.requires_grad]
        self.store: torch.Tensor | None = None  # the gradient; pieces' .grad are views into it
        self._views: list[torch.Tensor] = []  # per parameter, its part of `store`
        self._views_of: torch.Tensor | None = None  # the store `_views` view
        self.borrowed = False  # whether `store` is memory someone else reuses (take_reduced)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient as few tensors as possible, for norms and scaling: the whole store
        when every piece holds its part (padding and frozen parameters' parts are zero),
        else the pieces' own."""
        grads = self.grads()
        if self.store is not None and grads and len(grads) == len(self.params):
            return [self.store]
        return grads

    # -- gradients -------------------------------------------------------------------------
    @torch.no_grad()
    def take_reduced(self, reduced: torch.Tensor, borrow: bool = False) -> None:
        """Add one synchronised backward's averaged gradient of this shard (`shard_numel`
        elements, any float dtype): pieces without a .grad start from it, the others add it.

        borrow: when the dtypes agree, keep `reduced` itself as the store instead of copying it
            (ZeRO-1's full buckets: what pieces held is added into it); the owner of that
            memory calls `stop_borrowing` before it writes there again.
        """
        held = [p.grad is not None for p in self.params]
        if borrow and reduced.dtype == self.data.dtype:
            if any(held):  # what earlier rounds summed moves into `reduced`
                self._add_held_into(reduced)
            self.store, self.borrowed = reduced, True
            self._repoint_held_grads()
            return
        if not any(held):
            self._own_store().copy_(reduced)
        elif all(held):
            self.store.add_(reduced)
        else:
            for piece, (start, stop) in zip(self.pieces, self.ranges, strict=True):
                if piece is None or not piece.requires_grad:
                    continue
                if piece.grad is None:
                    self.store[start:stop].copy_(reduced[start:stop])
                else:
                    self.store[start:stop].add_(reduced[start:stop])

    def _add_held_into(self, target: torch.Tensor) -> None:
        for piece, (start, stop) in zip(self.pieces, self.ranges, strict=True):
            if piece is not None and piece.grad is not None:
                target[start:stop].add_(self.store[start:stop])

    def _own_store(self) -> torch.Tensor:
        """The shard's own gradient store, allocated once (padding zero) and then reused."""
        if self.store is None or self.borrowed:
            self.store = torch.zeros_like(self.data)
            self.borrowed = False
        return self.store

    @torch.no_grad()
    def stop_borrowing(self) -> None:
        """Copy a borrowed store into the shard's own memory (pieces' .grad follow), or drop it
        when no piece holds a gradient any more."""
        if not self.borrowed:
            return
        borrowed, self.store, self.borrowed = self.store, None, False
        if not any(p.grad is not None for p in self.params):
            return
        self._own_store().copy_(borrowed)
        self._repoint_held_grads()

    def clear_grads(self) -> None:
        for piece in self.params:
            piece.grad = None

    def attach_grads(self, used: list[bool]) -> None:
        """At the end of a synchronised round: each trainable piece whose parameter some rank
        used gets its view of the store as .grad ([Note: skipped parameters])."""
        if self.store is None:
            return
        for piece, was_used, view in zip(self.pieces, used, self._store_views(), strict=True):
            if piece is None or not piece.requires_grad or piece.grad is view:
                continue
            if was_used or piece.grad is not None:
                piece.grad = view

    def _store_views(self) -> list[torch.Tensor]:
        """Per parameter, its part of the current store (made once per store)."""
        if self._views_of is not self.store:
            self._views = [self.store[start:stop] for start, stop in self.ranges]
            self._views_of = self.store
        return self._views

    def _repoint_held_grads(self) -> None:
        """The store moved: the pieces that hold a gradient view the new one."""
        for piece, view in zip(self.pieces, self._store_views(), strict=True):
            if piece is not None and piece.grad is not None:
                piece.grad = view

    def nonfinite(self) -> torch.Tensor:
        """A 0-d bool tensor: whether the gradient this shard holds has an inf or NaN (the
        padding is zero). No host sync. Tested on the sum, which any inf or NaN makes
        non-finite: one read of the shard, where `isfinite(store).all()` also writes a bool per
        element (0.16 against 5.4 ms on gpt-small's 1.65M-element shard here). A sum that
        overflows (above 3e38 in fp32) counts as non-finite too: such a step is lost anyway."""
        return ~torch.isfinite(self.store.sum())

    @torch.no_grad()
    def poison(self) -> None:
        """Make the shard's gradient non-finite: some shard found an inf or NaN, and all ranks
        must skip the step together ([Note: found inf] in round.py).

        [Note: finite padding] Only the trainable pieces' parts are filled: the padding and
        frozen parameters' parts stay zero. The store may be a bucket's memory (ZeRO-1 borrows
        it) that the next backward reduces again, or be refilled piece by piece (accumulation);
        a NaN left outside the pieces would make every later sum, and so every later step,
        non-finite: the scaler would halve its scale forever and the model never train again
        (tests/dist/test_amp_overflow.py). `Bucket.complete` zeroes a bucket's padding before
        each reduction as well, whatever a hook may have left there."""
        if self.store is None:
            return
        for piece, (start, stop) in zip(self.pieces, self.ranges, strict=True):
            if piece is not None and piece.requires_grad:
                self.store[start:stop].fill_(float("nan"))

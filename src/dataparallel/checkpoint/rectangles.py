"""A run of a tensor's flattened elements as the hyper-rectangles it covers ([Note: chunks]
in dcp.py): how a flat shard is written as pieces of the tensor's true shape."""

from __future__ import annotations

import math


def rectangles(shape, start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes that together hold elements [start, stop) of a row-major
    tensor of `shape`, in order: a partial row, whole rows, a partial row, the partial ones
    split the same way one dimension down; at most 2(N-1)+1 boxes for N dimensions. Each box
    is itself a contiguous run of the flattened elements (all its leading sizes but one are
    1, its trailing sizes whole), so it is a view of the run's elements."""
    shape = tuple(int(n) for n in shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"rectangles: run [{start}, {stop}) is outside a tensor of {shape}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, a = divmod(start, inner)
    last, b = divmod(stop, inner)

    def within(row: int, lo: int, hi: int):
        return [((row, *o), (1, *s)) for o, s in rectangles(shape[1:], lo, hi)]

    if first == last:
        return within(first, a, b)
    out = []
    if a:
        out += within(first, a, inner)
        first += 1
    if last > first:
        out.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if b:
        out += within(last, 0, b)
    return out

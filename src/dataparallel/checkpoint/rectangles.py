"""A run of a tensor's flattened elements as the hyper-rectangles it covers
([Note: checkpoint chunks] in dcp.py): how a flat shard is written as pieces of the tensor's
true shape."""

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


def tiles(shape, boxes) -> bool:
    """Whether `boxes` ((offsets, sizes) pairs) tile a tensor of `shape` exactly, each box a
    contiguous run of the flattened elements (what `rectangles` makes): the runs, sorted,
    must follow each other from 0 to the last element. O(B log B) for B boxes. False does not
    mean they overlap: a box that is not one run, or is empty, is not judged here.

    [Note: tiling check] DCP's global save plan checks that every stored tensor's boxes are
    in bounds, disjoint and cover it, with a sweep along the tensor's largest dimension. Our
    boxes are runs of rows, and when that dimension is the rows' own (a matrix wider than it
    is tall) every box spans most of the sweep and is compared with every other: C^2 for the
    C pieces of a parameter, and C grows with the world (1 s of the coordinator's CPU for
    gpt-small at 4,096 ranks, BENCHMARKS.md "Cost as the world grows"). `ChunkSavePlanner`
    checks runs with this instead, and asks DCP's own check, for its messages, when this
    cannot say yes."""
    shape = tuple(int(n) for n in shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    runs = []
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return False
        if any(o < 0 or s < 1 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return False
        lead = next((d for d, s in enumerate(sizes) if s > 1), len(shape))
        if any(offsets[d] or sizes[d] != shape[d] for d in range(lead + 1, len(shape))):
            return False  # not one run of the flattened elements
        start = sum(o * stride for o, stride in zip(offsets, strides, strict=True))
        runs.append((start, math.prod(sizes)))
    at = 0
    for start, length in sorted(runs):
        if start != at:
            return False
        at += length
    return at == math.prod(shape)


def stacked(boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]):
    """`boxes` ((position in a flat buffer, offsets, sizes), in order) with each run of boxes
    that stack one after another along the first dimension, alike in the others, and lie one
    after another in the buffer, made one box: a tensor-parallel local tensor of column blocks
    is one run per row ([Note: checkpoint chunks]) and one box, not a box per row (a row-split
    MLP weight of gpt-tiny at tp 2 was 144 boxes per rank, each a DCP item of its own)."""
    out: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    for at, offsets, sizes in boxes:
        if out and sizes:
            first, before, size = out[-1]
            if (
                at == first + math.prod(size)
                and offsets[0] == before[0] + size[0]
                and (offsets[1:], sizes[1:]) == (before[1:], size[1:])
            ):
                out[-1] = (first, before, (size[0] + sizes[0], *size[1:]))
                continue
        out.append((at, tuple(offsets), tuple(sizes)))
    return out

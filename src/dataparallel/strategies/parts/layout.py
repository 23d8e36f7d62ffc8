"""The shard layout every sharded strategy uses: which rank owns which slice of a flat buffer.

Pure arithmetic, no process group, so it is tested on its own (tests/unit/test_sharding.py).

[Note: shard layout] A flat buffer holds parameters laid end to end (a ZeRO-1/2 bucket, a
ZeRO-3 unit), padded with zeros to a multiple of the shard count so it splits evenly: shard r
owns elements [r * s, (r + 1) * s) with s = numel / world_size. A parameter may straddle two
shards; a `Piece` is the part of one parameter inside one shard. Padding is never part of any
piece: it stays zero (zero gradient, zero value) and is never read back. `world_size` here is
the number of shards (the shard group's size under a 2-D mesh, docs/core.md), not of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of `world_size` (the size of an evenly shardable buffer)."""
    if world_size < 1:
        raise ValueError(f"padded_numel: world_size={world_size} must be >= 1")
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in one rank's shard.

    param: position of the parameter in the bucket.
    start: first element of the part, in the parameter's flattened elements.
    stop: one past its last element.
    shard_start: where the part begins inside the shard.
    """

    param: int
    start: int
    stop: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardLayout:
    """How one flat buffer splits evenly over the shards ([Note: shard layout]).

    sizes: elements of each parameter, in flat order.
    offsets: where each parameter starts in the flat buffer (same order).
    numel: elements in the flat buffer, padding included; a multiple of `world_size`.
    world_size: number of shards the buffer splits into.
    """

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    world_size: int

    def __post_init__(self):
        if len(self.sizes) != len(self.offsets):
            raise ValueError("ShardLayout: sizes and offsets must have the same length")
        if self.world_size < 1 or self.numel % self.world_size:
            raise ValueError(
                f"ShardLayout: numel={self.numel} must be a multiple of "
                f"world_size={self.world_size}; pad it with padded_numel"
            )
        if self.end > self.numel:
            raise ValueError(f"ShardLayout: parameters end at {self.end}, past numel={self.numel}")

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of `rank`'s slice in the flat bucket."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ShardLayout: rank={rank} is outside 0..{self.world_size - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of parameters inside `rank`'s slice, in bucket order."""
        lo, hi = self.shard_range(rank)
        out = []
        for position, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            start, stop = max(offset, lo), min(offset + size, hi)
            if start < stop:
                out.append(Piece(position, start - offset, stop - offset, start - lo))
        return out

    @classmethod
    def pack(cls, sizes: list[int] | tuple[int, ...], world_size: int) -> ShardLayout:
        """Parameters of `sizes` elements laid end to end, padded to split over `world_size`."""
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += n
        return cls(tuple(sizes), tuple(offsets), padded_numel(total, world_size), world_size)

    @property
    def end(self) -> int:
        """One past the last parameter element (where the padding starts)."""
        return max((o + n for o, n in zip(self.offsets, self.sizes, strict=True)), default=0)

    def local_slice(self, param: int, rank: int) -> tuple[int, int, int]:
        """(start, stop) of parameter `param` inside `rank`'s shard, and where that part starts
        inside the parameter; (0, 0, 0) when the parameter has no element there. The same
        arithmetic as `pieces`, for one parameter."""
        lo, hi = self.shard_range(rank)
        offset = self.offsets[param]
        start, stop = max(offset, lo), min(offset + self.sizes[param], hi)
        if start >= stop:
            return 0, 0, 0
        return start - lo, stop - lo, start - offset

    def holders(self, param: int) -> range:
        """The ranks whose shard holds an element of parameter `param`, in rank order (none for
        an empty parameter). Consecutive, so found by division: a walk over the ranks would
        cost every rank the world's size per parameter (owners.py's messages, each step)."""
        size = self.sizes[param]
        if size == 0:
            return range(0)
        first = self.offsets[param] // self.shard_numel
        return range(first, (self.offsets[param] + size - 1) // self.shard_numel + 1)

"""What a collective sends and how long it takes.

[Note: collective cost] The alpha-beta model of Thakur, Rabenseifner and Gropp 2005
("Optimization of collective communication operations in MPICH") with the ring's bandwidth
term (Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"): on k ranks a ring all-reduce of X bytes sends 2(k-1)/k X per rank, a
reduce-scatter or all-gather (k-1)/k X. A group spanning nodes is reduced hierarchically
(as NCCL does): the intra-node part runs over the node's links at their bus bandwidth, the
inter-node part moves the same fraction of X through the node's NICs, which the node's ranks
share. Latency: 2 ceil(log2 k) message steps per call (tree algorithms; a ring's 2(k-1) would
be far off at thousands of ranks), times the number of calls (buckets, units).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..comm.wire import wire_fraction
from .hardware import HardwareProfile

# bandwidth factor per rank of X: how many X each rank sends in a ring
RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


@dataclass(frozen=True)
class Span:
    """Where a group's ranks sit: `size` ranks, `local` of them on each of `nodes` nodes."""

    size: int
    local: int
    nodes: int


def span(size: int, stride: int, world: int, ranks_per_node: int) -> Span:
    """A group of `size` ranks `stride` apart among `world` consecutive ranks (a shard group
    has stride 1, a replicate group stride S, [Note: mesh] in strategies/parts/mesh.py)."""
    per_node = min(ranks_per_node, world)
    local = max(1, min(size, per_node // stride)) if stride < per_node else 1
    return Span(size, local, max(1, size // local))


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of collective a strategy issues, per optimizer step.

    what: what it moves ("gradients", "parameters", ...).
    kind: all_reduce, reduce_scatter or all_gather.
    buffer_bytes: X, the whole buffer (for a gather, the gathered result).
    group: where its ranks sit.
    calls: calls per step (buckets, units, micro-batches), each paying the latency.
    window: the computation it can hide behind: "forward", "backward", "none", or "steps":
        `overlap_steps` whole inner steps (a streamed DiLoCo fragment's outer all-reduce).
    every: issued once every `every` steps (DiLoCo's outer all-reduce of a fragment: H / F).
    overlap_steps: with window "steps", the inner steps it runs behind (tau).
    """

    what: str
    kind: str
    buffer_bytes: float
    group: Span
    calls: int = 1
    window: str = "backward"
    every: float = 1
    overlap_steps: int = 0

    def bytes_sent(self) -> float:
        """Bytes one rank puts on the wire per step, as a run counts them ([Note: bytes on the
        wire] in comm/wire.py; a gather's payload is one rank's part of `buffer_bytes`)."""
        k = self.group.size
        payload = self.buffer_bytes / k if self.kind == "all_gather" else self.buffer_bytes
        return wire_fraction(self.kind, k) * payload / self.every

    def seconds(self, hw: HardwareProfile) -> float:
        """Seconds per step ([Note: collective cost])."""
        g, x = self.group, self.buffer_bytes
        if g.size == 1 or x == 0:
            return 0.0
        factor = RING_FACTOR[self.kind]
        intra = hw.intra_node[self.kind]
        t = factor * (g.local - 1) / g.local * x / intra.bandwidth
        t += self.calls * 2 * math.ceil(math.log2(g.local)) * intra.latency if g.local > 1 else 0
        if g.nodes > 1:
            # After the intra-node stage each local rank holds x / local; the node's ranks all
            # talk across at once, so each gets 1 / ranks_per_node of the node's NICs.
            share = hw.inter_node.bandwidth / hw.ranks_per_node
            t += factor * (g.nodes - 1) / g.nodes * (x / g.local) / share
            t += self.calls * 2 * math.ceil(math.log2(g.nodes)) * hw.inter_node.latency
        return t / self.every


def compressed_bytes(kind: str, arg: float, numel: float, matrices, params: int) -> tuple:
    """(collective kind, buffer bytes per rank) of a compressed gradient all-reduce of `numel`
    fp32 values, and whether it keeps an error-feedback residual.

    powersgd r: each m x n matrix sends (m + n) r fp32 values (all-reduced, as P and Q are);
        vectors, and matrices where that is no saving, go uncompressed.
    topk rho: rho n fp32 values + rho n int32 indices (8 bytes an entry), all-gathered
        (sparse sums do not reduce in place): the buffer is every rank's, so x N.
    int8 / fp8: 1 byte per value + a fp32 scale per 1024-value block, reduce-scatter then
        all-gather of the quantised chunks (all-reduce volume).
    bf16: 2 bytes per value, all-reduced, no residual (a rounding, not a compressor).
    """
    fraction = numel / params if params else 1.0  # this collective's share of the model
    if kind == "powersgd":
        # compression/powersgd.py's rule: rank min(m, n, r), and only where that shrinks the
        # matrix at least twice (PyTorch's min_compression_rate).
        def shrinks(m, n):
            return (m + n) * min(m, n, int(arg)) * 2 < m * n

        dense = sum(m * n for m, n in matrices)
        small = sum(m * n for m, n in matrices if not shrinks(m, n))
        low_rank = sum((m + n) * min(m, n, int(arg)) for m, n in matrices if shrinks(m, n))
        values = (params - dense) + small + low_rank
        return "all_reduce", 4 * values * fraction, True
    if kind == "topk":
        return "all_gather", 8 * arg * numel, True
    if kind in ("int8", "fp8"):
        return "all_reduce", numel * (1 + 4 / 1024), True
    if kind == "bf16":
        return "all_reduce", 2 * numel, False
    return "all_reduce", 4 * numel, False

"""Bytes on the wire: what one rank puts on its links for a collective, from its algorithm.

[Note: bytes on the wire] `Comm.bytes_sent` counts the payload handed to each collective (a
tensor's size); what crosses the link depends on the algorithm the collective runs. On k ranks,
for a payload of X bytes (the tensor the rank hands over):
- all_reduce: a ring (gloo's ring all-reduce, NCCL's ring) runs a reduce-scatter then an
  all-gather, each sending (k-1)/k of the buffer: 2 (k-1)/k X per rank;
- reduce_scatter (X: the whole input buffer): ring or pairwise ([Note: pairwise collectives]
  in pairwise.py: each rank sends every other rank its chunk): (k-1)/k X;
- all_gather (X: this rank's shard): ring or pairwise, the shard goes to each of the k-1 others:
  (k-1) X;
- all_to_all (X: the whole input, one chunk per rank): the k-1 chunks for the others, (k-1)/k X;
- broadcast: a pipelined chain (gloo) or ring (NCCL): every rank but the last forwards the X
  bytes once, (k-1)/k X per rank on average (the figure given for every rank).
One rank alone sends nothing. These are the bandwidth terms of the ring algorithms the planner
models too ([Note: collective cost] in plan/collectives.py), so a run's measured wire bytes and
the planner's prediction count the same thing. An int8 reduction (an all-to-all and an
all-gather of about a quarter of the fp32 bytes each) puts about 1/4 of a fp32 ring
all-reduce's bytes on the wire: X_int8 (k-1)/k (1 + 1) against 2 (k-1)/k X_fp32.
"""

from __future__ import annotations

# bytes each rank sends per byte of payload, times (k - 1) / k ...
_PER_PAYLOAD = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "broadcast": 1.0}
# ... or times (k - 1): the payload is one rank's part of the result
_PER_SHARD = {"all_gather": 1.0}
KINDS = tuple(_PER_PAYLOAD) + tuple(_PER_SHARD)


def wire_fraction(kind: str, ranks: int) -> float:
    """Bytes one rank sends per byte of the payload it hands to a `kind` collective."""
    if ranks < 1:
        raise ValueError(f"wire_fraction: ranks={ranks} must be >= 1")
    if kind in _PER_SHARD:
        return _PER_SHARD[kind] * (ranks - 1)
    if kind in _PER_PAYLOAD:
        return _PER_PAYLOAD[kind] * (ranks - 1) / ranks
    raise ValueError(f"wire_fraction: unknown collective {kind!r}; one of {', '.join(KINDS)}")


def wire_bytes(kind: str, payload: int, ranks: int) -> int:
    """Bytes one rank puts on its links for one `kind` collective of `payload` bytes."""
    return round(wire_fraction(kind, ranks) * payload)

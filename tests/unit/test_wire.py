"""Bytes on the wire from each collective's algorithm ([Note: bytes on the wire])."""

from __future__ import annotations

import pytest

from dataparallel.comm.wire import wire_bytes, wire_fraction


@pytest.mark.parametrize(
    "kind, ranks, expected",
    [
        ("all_reduce", 2, 1.0),  # a ring: reduce-scatter + all-gather, (k-1)/k each
        ("all_reduce", 4, 1.5),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 4, 0.75),
        ("all_gather", 4, 3.0),  # this rank's shard to each of the 3 others
        ("broadcast", 4, 0.75),
        ("all_reduce", 1, 0.0),
        ("all_gather", 1, 0.0),
    ],
)
def test_fractions(kind, ranks, expected):
    assert wire_fraction(kind, ranks) == expected


def test_a_ring_all_reduce_is_its_reduce_scatter_and_all_gather():
    n, k = 4096, 8
    assert wire_bytes("all_reduce", n, k) == wire_bytes("reduce_scatter", n, k) + wire_bytes(
        "all_gather", n // k, k
    )


def test_unknown_kinds_and_worlds_are_refused():
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        wire_fraction("gossip", 2)
    with pytest.raises(ValueError, match="ranks=0"):
        wire_fraction("all_reduce", 0)

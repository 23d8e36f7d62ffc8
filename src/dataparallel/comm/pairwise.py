"""Reduce-scatter and all-gather as pairwise exchanges of point-to-point messages.

[Note: pairwise collectives] On gloo (CPU) a reduce-scatter or an all-gather can be built from
`torch.distributed.isend`/`irecv`: every rank sends each peer the chunk that peer owns (or, for
an all-gather, its own chunk) and receives one from each peer, all posted at once. That moves
(N-1)/N of the buffer in and out of each rank, the bytes of a ring, and gloo sends each message
straight from the tensor on its I/O thread. On our 2-core machine it cost about half of gloo's
own collectives on the same 13 MB (`benchmarks/bench_collective.py`, 2 ranks, CPU per rank):
reduce-scatter 4.8 ms against 10.4 for gloo's `reduce_scatter` (and 8.9 for an `all_reduce`),
all-gather 4.1 ms against 7.8. An all-reduce built the same way (reduce-scatter, then
all-gather) measured within noise of gloo's, so all-reduce stays gloo's own.

Matching: gloo pairs a send with the receive of the same (peer, tag), and between one pair of
ranks, messages of one tag in the order they were posted. Every rank issues collectives in the
same order (the rule all collectives follow) and each exchange takes the next tag of its
`Comm` (a count, with the kind in the lowest bit), so the n-th exchange of one rank meets the
n-th of every other, even with several in flight. Two Comms on one group (two parallelized
models) reuse tags; the order rule and gloo's posting order still pair them right. Our tags
start at 2**30: gloo's own collectives tag their messages from 2**56 up, and
`monitored_barrier` and users' own `send`/`recv` use small tags, so neither meets ours unless
a user picks tags that high. What breaks the order rule (ranks gathering units in different
orders) hangs with gloo's own collectives; with ours an exchange could meet one of the same
kind and size, so the rule matters more here.

Completion: gloo marks a point-to-point message complete only when it is waited for, so
`is_completed()` is False until `wait()` (code that polls must also bound what it leaves in
flight; see the reducer's `max_in_flight`). The reduce-scatter's sum, this rank's chunk plus
the others' in rank order, is done by `wait()` on the calling thread; its receive buffer
((N-1)/N of the input) lives until then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class PairwiseWork:
    """Messages in flight and what to do once all have arrived, behind `Work`'s two calls."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None):
        self.works = works
        self.finish = finish
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> bool:
        if not self.completed:
            for work in self.works:
                work.wait()
            self.works = []
            if self.finish is not None:
                self.finish()
                self.finish = None  # drops the receive buffer too
            self.completed = True
        return True


def _exchange(group, ranks: list[int], rank: int, tag: int, sends, recvs) -> list:
    """Post a send to and a receive from every peer: sends[p] goes to group rank p, recvs[p]
    comes from it. `ranks` maps group ranks to global ones (what isend/irecv take before torch
    2.6, which added group_dst/group_src)."""
    works, world_size = [], len(ranks)
    for step in range(1, world_size):
        # Peers in rotated order (rank+1, rank+2, ...), so that not every rank starts with 0.
        peer, source = (rank + step) % world_size, (rank - step) % world_size
        works.append(dist.isend(sends[peer], dst=ranks[peer], group=group, tag=tag))
        works.append(dist.irecv(recvs[source], src=ranks[source], group=group, tag=tag))
    return works


def all_gather(output, input, group, ranks: list[int], rank: int, tag: int) -> PairwiseWork:
    """Every rank's `input` into its chunk of `output` (world_size * input.numel() elements)."""
    world_size = len(ranks)
    chunks = output.view(-1).chunk(world_size)
    if chunks[rank].data_ptr() != input.data_ptr():
        chunks[rank].copy_(input.view(-1))
    sends = [input.view(-1)] * world_size
    return PairwiseWork(_exchange(group, ranks, rank, tag, sends, chunks))


def reduce_scatter(output, input, group, ranks: list[int], rank: int, tag: int) -> PairwiseWork:
    """The sum across ranks of this rank's chunk of `input` (world_size equal chunks), into
    `output`, which may be that chunk itself (in place). The other chunks must stay untouched
    until `wait()`, which adds what arrived."""
    world_size = len(ranks)
    chunks = input.view(-1).chunk(world_size)
    others = [p for p in range(world_size) if p != rank]
    scratch = torch.empty(len(others), output.numel(), dtype=output.dtype, device=output.device)
    arrived = dict(zip(others, scratch, strict=True))
    works = _exchange(group, ranks, rank, tag, chunks, arrived)
    target = output.view(-1)

    def finish():
        source = chunks[rank]
        for p in others:
            torch.add(source, arrived[p], out=target)
            source = target

    return PairwiseWork(works, finish)

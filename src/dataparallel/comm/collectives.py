"""A thin layer over torch.distributed collectives: explicit group, byte accounting, a trace.

Every strategy talks to other ranks through a `Comm`, never through `torch.distributed`
directly, so that bytes moved per step can be reported and a trace can show when each
collective started and finished relative to compute.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from . import pairwise
from .plain import all_gather_plain
from .progress import PROGRESS, Progress, check_collective
from .trace import Span, TracedWork, TraceEvent, Tracer
from .wire import wire_bytes

__all__ = ["Comm", "TraceEvent", "Tracer"]

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """Collectives on one process group, counting the bytes each kind of collective moved.

    `bytes_sent[kind]` counts the payload handed to each collective (the tensor's size);
    `wire_sent[kind]` what this rank put on its links for it, from the collective's algorithm
    ([Note: bytes on the wire] in wire.py).

    pairwise: build reduce-scatter and all-gather of CPU tensors from point-to-point messages
        ([Note: pairwise collectives] in pairwise.py); None means yes on gloo, where they cost
        half of gloo's own, and no elsewhere (NCCL's are the fast ones).
    progress: where each collective is numbered and its waits listed, for the watchdog and the
        checked mode ([Note: collective progress] in progress.py); the process's by default.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        tracer: Tracer | None = None,
        pairwise: bool | None = None,
        progress: Progress | None = None,
    ):
        self.progress = progress if progress is not None else PROGRESS
        self._bind(group if group is not None else dist.group.WORLD)
        # Small control tensors (flags, counts) live where the backend can send them.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.tracer = tracer if tracer is not None else Tracer()
        self.pairwise = self.backend == "gloo" if pairwise is None else pairwise
        self.bytes_sent: Counter[str] = Counter()
        self.wire_sent: Counter[str] = Counter()  # [Note: bytes on the wire] in wire.py
        self.calls: Counter[str] = Counter()

    def _bind(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.group_name = self.progress.register(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self._tag = 0  # exchanges so far, for the next tag ([Note: pairwise collectives])
        self._ranks: list[int] | None = None  # group rank -> global rank, for isend/irecv

    def rebind(self, group: dist.ProcessGroup) -> None:
        """Talk through `group` from now on (a live run's next generation, train/live/recovery.py):
        its rank and size replace the old group's; the byte counts go on. Nothing may be in
        flight on the old group."""
        if dist.get_backend(group) != self.backend:
            raise ValueError(
                f"Comm.rebind: a {dist.get_backend(group)} group for a {self.backend} one"
            )
        self._bind(group)

    def _run(self, kind: str, tensor: torch.Tensor, async_op: bool, call, how=None):
        """Count the payload, number it, run `call`, and trace it ([Note: trace spans] in
        trace.py); a synchronous call is listed as waited on while it runs ([Note: collective
        progress] in progress.py). `how`: the reduce op or broadcast source, for the checked
        mode's fingerprint."""
        size = tensor.numel() * tensor.element_size()
        self.bytes_sent[kind] += size
        self.wire_sent[kind] += wire_bytes(kind, size, self.world_size)
        self.calls[kind] += 1
        tracer, progress = self.tracer, self.progress
        collective = progress.launch(self.group_name, kind, tracer.label)
        if progress.check:
            check_collective(self.group, collective, tensor, how, progress)
        if not tracer.enabled:
            if async_op:
                return TracedWork(call(), tracer, kind, None, 0, collective, progress)
            token = progress.begin_wait(collective)
            try:
                return call()
            finally:
                progress.end_wait(token)
        args = {"bytes": size, "ranks": self.world_size, **tracer.label}
        start = time.perf_counter_ns()
        if async_op:
            return TracedWork(call(), tracer, kind, args, start, collective, progress)
        token = progress.begin_wait(collective)
        try:
            result = call()
        finally:
            progress.end_wait(token)
        end = time.perf_counter_ns()
        tracer.add(Span(kind, "comm", start, end, {**args, "end": "returned"}))
        tracer.add(Span("wait", "blocked", start, end, {"kind": kind, **args}))
        return result

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        def call():
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

        return self._run("all_reduce", tensor, async_op, call, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        global_src = dist.get_global_rank(self.group, src)

        def call():
            return dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)

        return self._run("broadcast", tensor, async_op, call, src)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, async_op=False
    ):
        """Sum `input` (world_size * output.numel() elements) across ranks; keep this rank's part."""

        def call():
            if self._pairwise_for("reduce_scatter", output, input) and op == dist.ReduceOp.SUM:
                args = (output, input, self.group, self._global_ranks(), self.rank)
                work = pairwise.reduce_scatter(*args, self._next_tag(0))
                return _wait_unless_async(async_op, work)
            return _reduce_scatter(output, input, op=op, group=self.group, async_op=async_op)

        return self._run("reduce_scatter", input, async_op, call, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's `input` into `output` (world_size * input.numel() elements)."""

        def call():
            if self._pairwise_for("all_gather", input, output):
                args = (output, input, self.group, self._global_ranks(), self.rank)
                return _wait_unless_async(async_op, pairwise.all_gather(*args, self._next_tag(1)))
            return _all_gather(output, input, group=self.group, async_op=async_op)

        return self._run("all_gather", input, async_op, call)

    def sharded_reduce(self, device: torch.device) -> str:
        """The cheaper way here to give each rank its slice of summed gradients on `device`
        (what "auto" means for the sharded strategies).

        "reduce_scatter" (half an all-reduce's bytes) on NCCL and with pairwise collectives;
        "all_reduce" on gloo without them (or for CUDA tensors), where gloo's own
        reduce-scatter took longer than its all-reduce of the same buffer (10.4 against 8.9 ms
        of CPU on 13 MB, 2 ranks).
        """
        if self.backend == "gloo" and not (self.pairwise and device.type == "cpu"):
            return "all_reduce"
        return "reduce_scatter"

    def _pairwise_for(self, op: str, shard: torch.Tensor, full: torch.Tensor) -> bool:
        """Whether `op` runs pairwise; first refuses a shard and full tensor that do not fit."""
        if not self.pairwise or self.world_size == 1:
            return False
        if shard.numel() * self.world_size != full.numel() or shard.dtype != full.dtype:
            raise ValueError(
                f"Comm.{op}: the full tensor ({full.numel()} x {full.dtype}) must hold world "
                f"size {self.world_size} x the shard ({shard.numel()} x {shard.dtype}); pass "
                "tensors of one dtype whose sizes differ by the world size"
            )
        cpu = shard.device.type == "cpu" and full.device.type == "cpu"
        return cpu and shard.is_contiguous() and full.is_contiguous()

    def _next_tag(self, kind: int) -> int:
        """The next exchange's tag: 2**30, a count, and the kind (0 reduce-scatter, 1
        all-gather), so that a reduce-scatter never meets an all-gather ([Note: pairwise
        collectives])."""
        self._tag = self._tag % (1 << 23) + 1
        return 1 << 30 | self._tag << 1 | kind

    def _global_ranks(self) -> list[int]:
        if self._ranks is None:
            self._ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        return self._ranks

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Send the i-th of `input`'s world_size equal chunks to rank i; receive rank i's chunk
        for this rank into the i-th chunk of `output` (compressed reductions, compression/)."""

        def call():
            return dist.all_to_all_single(output, input, group=self.group, async_op=async_op)

        return self._run("all_to_all", input, async_op, call)

    def send_recv(self, sends: dict, recvs: dict) -> None:
        """Point-to-point messages within the group, waited for: `sends[(peer, dtype)]` goes
        to group rank `peer`, `recvs[(peer, dtype)]` is filled from it (whole-parameter
        ownership, strategies/parts/owners.py). Every rank of the group calls it, in one order,
        even with nothing to send: the exchange takes the next tag ([Note: pairwise
        collectives] in pairwise.py), and messages of one pair are posted in key order."""
        tag, ranks, works = self._next_tag(0), self._global_ranks(), []
        order = lambda key: (key[0], str(key[1]))  # noqa: E731
        for peer, dtype in sorted(sends, key=order):
            tensor = sends[(peer, dtype)]
            size = tensor.numel() * tensor.element_size()
            self.bytes_sent["send_recv"] += size
            self.wire_sent["send_recv"] += size
            works.append(dist.isend(tensor, dst=ranks[peer], group=self.group, tag=tag))
        for peer, dtype in sorted(recvs, key=order):
            works.append(
                dist.irecv(recvs[(peer, dtype)], src=ranks[peer], group=self.group, tag=tag)
            )
        self.calls["send_recv"] += 1
        for work in works:
            work.wait()

    def total_bytes(self) -> int:
        """Bytes handed to every kind of collective so far."""
        return sum(self.bytes_sent.values())

    def total_wire_bytes(self) -> int:
        """Bytes this rank put on its links so far ([Note: bytes on the wire] in wire.py)."""
        return sum(self.wire_sent.values())

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order: plain values and tensors only, sent as JSON and
        raw bytes, never pickled ([Note: nothing unpickled] in plain.py)."""
        out: list = [None] * self.world_size
        progress = self.progress
        collective = progress.launch(self.group_name, "all_gather_object", self.tracer.label)
        if progress.check:
            check_collective(self.group, collective, None, progress=progress)
        token = progress.begin_wait(collective)
        try:
            out = all_gather_plain(obj, group=self.group)  # [Note: nothing unpickled]
        finally:
            progress.end_wait(token)
        self.calls["all_gather_object"] += 1
        return out

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast many tensors as one flat message per dtype (one collective, not one each)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast(flat, src=src)
            if self.rank == src:
                continue
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def reset_counters(self) -> None:
        self.bytes_sent.clear()
        self.wire_sent.clear()
        self.calls.clear()


def _wait_unless_async(async_op: bool, work: pairwise.PairwiseWork):
    if async_op:
        return work
    work.wait()
    return None

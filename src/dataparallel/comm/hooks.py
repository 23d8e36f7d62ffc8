"""Communication hooks: how one bucket of gradients is reduced across ranks.

[Note: reduction interface] Every strategy reduces its gradients through one interface, PyTorch
DDP's: `hook(state, bucket) -> future`. DDP's buckets, ZeRO-1/2's buckets and ZeRO-3's units
all reach the hook as a bucket with
- `index`: its launch position in this backward (the same on every rank);
- `buffer`: the flat gradients, 1-D, padded with zeros to a multiple of the shard group's size;
- `shard`: None when every rank keeps the whole reduced buffer (DDP), or `(start, stop)`, the
  slice of `buffer` that this rank keeps (sharded strategies): the hook may then deliver only
  that slice (a reduce-scatter), and nothing outside it is read afterwards;
- `shapes`: `(offset, shape)` of each parameter's gradient in `buffer` (for hooks that work
  per matrix, such as PowerSGD).
The state (`HookState`) names the groups: `comm`, over which the bucket is reduced (for a sharded
bucket, the shard group: `shard` is this rank's slice in it), and `replicate`, the ranks that
hold the same shard under a 2-D mesh (None without one), over which the result is all-reduced
after (docs/core.md).

The future's `wait()` returns the reduced values: the buffer itself (reduced in place), the
shard's slice of it, or a new tensor of either size, which the bucket copies in. `done()` says
whether `wait()` would block. A `torch.futures.Future` is such an object.

Averaging happens in one place, before the hook: the buffer already holds this rank's gradient
divided by the number of ranks averaged over (the reducer divides while it copies autograd's
gradient in: one pass, and low-precision sums of averaged terms cannot overflow where the
average does not). A hook therefore *sums*. Hooks run on the training thread; a `.then`
continuation runs on the backend's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .collectives import Comm


class GradBucket(Protocol):
    """What a hook sees of a bucket ([Note: reduction interface])."""

    index: int
    buffer: torch.Tensor
    shard: tuple[int, int] | None
    shapes: list[tuple[int, torch.Size]]


@dataclass
class HookState:
    """State every built-in hook reads.

    comm: the group the bucket is reduced over first (all ranks for DDP, the shard group for
        a sharded strategy).
    replicate: the ranks holding the same shard under a 2-D mesh, whose results are summed
        after the first stage; None when there is one replica.
    """

    comm: Comm
    replicate: Comm | None = None


def reduce_hook(state: HookState, bucket: GradBucket):
    """The default: reduce-scatter a sharded bucket into its shard, all-reduce a whole one;
    then all-reduce the result across replicas (2-D mesh)."""
    if bucket.shard is None:
        return allreduce_hook(state, bucket)
    return reduce_scatter_hook(state, bucket)


def allreduce_hook(state: HookState, bucket: GradBucket):
    """Sum the whole bucket in place; then, across replicas, only what this rank keeps."""
    buffer = bucket.buffer
    keep = buffer if bucket.shard is None else _slice(buffer, bucket.shard)
    if state.comm.world_size == 1:
        return _across_replicas(state, bucket, Ready(keep))
    work = state.comm.all_reduce(buffer, async_op=True)
    return _across_replicas(state, bucket, WorkFuture(work, lambda: keep))


def reduce_scatter_hook(state: HookState, bucket: GradBucket):
    """Reduce-scatter a sharded bucket in place: the shard receives the sum, the rest is stale.

    In place is safe: the output is the rank's own chunk of the input (NCCL and gloo allow it).
    """
    if bucket.shard is None:
        raise ValueError(
            "reduce_scatter_hook: this bucket is kept whole on every rank (shard is None); "
            "use allreduce_hook or reduce_hook"
        )
    buffer = bucket.buffer
    own = buffer[bucket.shard[0] : bucket.shard[1]]
    if state.comm.world_size == 1:
        return _across_replicas(state, bucket, Ready(own))
    work = state.comm.reduce_scatter(own, buffer, async_op=True)
    return _across_replicas(state, bucket, WorkFuture(work, lambda: own))


def low_precision_hook(dtype: torch.dtype, first=reduce_hook):
    """A hook that sends the bucket in `dtype` (torch.float16 or torch.bfloat16) and writes the
    sums back in the bucket's own dtype: half the bytes of fp32 on the wire.

    The bucket arrives divided (module docstring), so a float16 sum of N averaged terms cannot
    overflow where the average itself would not. `first` is the full-precision hook it wraps.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_precision_hook: dtype={dtype} must be float16 or bfloat16")

    def hook(state: HookState, bucket: GradBucket):
        low = _LowBucket(bucket.index, bucket.buffer.to(dtype), bucket.shard)
        inner = first(state, low)
        target = bucket.buffer if bucket.shard is None else _slice(bucket.buffer, bucket.shard)

        def write_back(result: torch.Tensor) -> torch.Tensor:
            if result.numel() != target.numel():  # the whole buffer, of which we keep a shard
                result = _slice(result.view(-1), bucket.shard)
            return target.copy_(result.view(-1))

        return Then(inner, write_back)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_hook"
    return hook


def compressed_allreduce_hook(dtype: torch.dtype):
    """DDP's name for `low_precision_hook(dtype)`: the whole bucket all-reduced in `dtype`."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"compressed_allreduce_hook: dtype={dtype} must be float16 or bfloat16")
    return low_precision_hook(dtype, allreduce_hook)


def default_hook(kind: str, wire: torch.dtype | None = None):
    """The built-in hook a strategy uses when given none: `kind` "all_reduce" reduces whole
    buckets everywhere, "reduce_scatter" each sharded bucket to its shard (`reduce_hook`);
    `wire`, a dtype narrower than the buckets' to send them in (a policy's `reduce_dtype`)."""
    first = allreduce_hook if kind == "all_reduce" else reduce_hook
    return low_precision_hook(wire, first) if wire is not None else first


fp16_compress_hook = low_precision_hook(torch.float16)
bf16_compress_hook = low_precision_hook(torch.bfloat16)


@dataclass
class _LowBucket:
    index: int
    buffer: torch.Tensor
    shard: tuple[int, int] | None


def _slice(buffer: torch.Tensor, shard: tuple[int, int]) -> torch.Tensor:
    return buffer[shard[0] : shard[1]]


def _across_replicas(state: HookState, bucket: GradBucket, first):
    """After the first stage, all-reduce what this rank keeps over the replicas (2-D mesh)."""
    replicate = state.replicate
    if replicate is None or replicate.world_size == 1:
        return first

    def second(result: torch.Tensor):
        return WorkFuture(replicate.all_reduce(result, async_op=True), lambda: result)

    return Chain(first, second)


class WorkFuture:
    """The two calls made on a future (`done`, `wait`), over a bare Work.

    gloo's reduce-scatter Work has no `get_future()`; `finish` runs at `wait`, on the training
    thread, and gives the future's value.
    """

    def __init__(self, work, finish):
        self.work = work
        self.finish = finish

    def done(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.finish()


class Ready:
    """A future whose value is already there (a group of one rank: nothing to send)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self.value


class Then:
    """`inner`'s value passed through `finish` at `wait`, on the training thread."""

    def __init__(self, inner, finish):
        self.inner, self.finish = inner, finish

    def done(self) -> bool:
        return self.inner.done()

    def wait(self) -> torch.Tensor:
        result = self.inner.wait()
        return self.finish(result[0] if isinstance(result, list) else result)


class Chain:
    """Two stages: `second(value of first)` is launched once the first has arrived, when waited
    for on the training thread (so every rank launches it in the same order)."""

    def __init__(self, first, second):
        self.first, self.second = first, second
        self.next = None

    def done(self) -> bool:
        return self.next is not None and self.next.done()

    def wait(self) -> torch.Tensor:
        if self.next is None:
            result = self.first.wait()
            self.next = self.second(result[0] if isinstance(result, list) else result)
        return self.next.wait()

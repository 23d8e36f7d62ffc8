"""Communication hooks: how one bucket of gradients is reduced across ranks.

A hook has the signature `hook(state, bucket) -> torch.futures.Future[torch.Tensor]`, like
PyTorch DDP's: it starts the communication for `bucket.buffer` (a flat gradient tensor) and
returns a future whose value is the reduced tensor. The reducer copies that value into the
bucket if it is not the buffer itself, so a hook may reduce in place or return a new tensor.
Hooks run on the training thread; the continuations (`.then`) run on the comm thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .collectives import Comm


class GradBucket(Protocol):
    """What a hook sees of a bucket: its position in launch order and its flat gradients."""

    index: int
    buffer: torch.Tensor


@dataclass
class HookState:
    """State every built-in hook reads.

    comm: the collectives of the strategy's process group.
    mean: divide by the world size (average across ranks); False keeps the sum.
    """

    comm: Comm
    mean: bool = True


def allreduce_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in place; average by dividing once the sum has arrived."""
    buffer = bucket.buffer
    fut = state.comm.all_reduce(buffer, async_op=True).get_future()
    world_size = state.comm.world_size

    def finish(_):
        if state.mean and world_size > 1:
            buffer.div_(world_size)
        return buffer

    return fut.then(finish)


def compressed_allreduce_hook(dtype: torch.dtype):
    """A hook that sends the bucket in `dtype` (torch.float16 or torch.bfloat16).

    Halves the bytes on the wire. The bucket is divided by the world size in full precision
    before the cast and the reduction, so an fp16 sum of N averaged terms cannot overflow where
    the average itself would not.
    The result is cast back into the full-precision bucket.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"compressed_allreduce_hook: dtype={dtype} must be float16 or bfloat16")

    def hook(state: HookState, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer
        if state.mean and state.comm.world_size > 1:  # divide first: a value that fits once
            low = torch.div(buffer, state.comm.world_size).to(dtype)  # averaged still fits
        else:
            low = buffer.to(dtype)
        fut = state.comm.all_reduce(low, async_op=True).get_future()

        def finish(_):
            buffer.copy_(low)
            return buffer

        return fut.then(finish)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


fp16_compress_hook = compressed_allreduce_hook(torch.float16)
bf16_compress_hook = compressed_allreduce_hook(torch.bfloat16)


def reduce_scatter_hook(state: HookState, bucket: GradBucket) -> WorkFuture:
    """Reduce-scatter a bucket in place: this rank's slice receives the mean, the rest is stale.

    For sharded strategies (ZeRO-2), where each rank keeps only its slice of every bucket.

    In place is safe: the output is the rank's own chunk of the input (NCCL and gloo allow it).
    """
    comm, buffer = state.comm, bucket.buffer
    size = buffer.numel() // comm.world_size
    own = buffer[comm.rank * size : (comm.rank + 1) * size]
    work = comm.reduce_scatter(own, buffer, async_op=True)

    def finish():
        if state.mean and comm.world_size > 1:
            own.div_(comm.world_size)
        return buffer

    return WorkFuture(work, finish)


class WorkFuture:
    """The two calls the reducer makes on a future (`done`, `wait`), over a bare Work.

    gloo's reduce-scatter Work has no `get_future()`, so the division by the world size runs at
    `wait` on the training thread instead of in a continuation on the comm thread.
    """

    def __init__(self, work, finish):
        self.work = work
        self.finish = finish

    def done(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.finish()

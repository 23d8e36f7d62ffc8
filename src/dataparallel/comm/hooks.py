"""Communication hooks: how one bucket of gradients is reduced across ranks.

A hook has the signature `hook(state, bucket) -> torch.futures.Future[torch.Tensor]`, like
PyTorch DDP's: it starts the communication for `bucket.buffer` (a flat gradient tensor) and
returns a future whose value is the reduced tensor. The reducer copies that value into the
bucket if it is not the buffer itself, so a hook may reduce in place or return a new tensor.
Hooks run on the training thread; the continuations (`.then`) run on the comm thread.

A hook *sums*. When gradients are averaged (the default), the buffer a hook receives already
holds this rank's gradient divided by the world size: the reducer divides while it copies
autograd's gradient into the bucket, one pass instead of a copy and a division (as PyTorch's
DDP does), and dividing before the sum keeps low-precision sums from overflowing.
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
    """

    comm: Comm


def allreduce_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future:
    """Sum the bucket across ranks, in place."""
    return state.comm.all_reduce(bucket.buffer, async_op=True).get_future()


def compressed_allreduce_hook(dtype: torch.dtype):
    """A hook that sends the bucket in `dtype` (torch.float16 or torch.bfloat16).

    Halves the bytes on the wire. The bucket arrives divided by the world size (module
    docstring), so an fp16 sum of N averaged terms cannot overflow where the average itself
    would not. The result is cast back into the full-precision bucket.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"compressed_allreduce_hook: dtype={dtype} must be float16 or bfloat16")

    def hook(state: HookState, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer
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
    """Reduce-scatter a bucket in place: this rank's slice receives the sum, the rest is stale.

    For sharded strategies (ZeRO-2), where each rank keeps only its slice of every bucket.

    In place is safe: the output is the rank's own chunk of the input (NCCL and gloo allow it).
    """
    comm, buffer = state.comm, bucket.buffer
    size = buffer.numel() // comm.world_size
    own = buffer[comm.rank * size : (comm.rank + 1) * size]
    work = comm.reduce_scatter(own, buffer, async_op=True)
    return WorkFuture(work, lambda: buffer)


class WorkFuture:
    """The two calls the reducer makes on a future (`done`, `wait`), over a bare Work.

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

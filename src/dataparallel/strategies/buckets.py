"""Gradient buckets: a pure plan of which parameters share a flat buffer, and the bucket itself.

[Note: bucket order] Parameters are planned in *reverse* registration order, because backward
produces gradients roughly from the last layer to the first. Buckets are numbered in that order
and every rank launches them strictly by number (bucket i+1 never before bucket i): collectives
on one process group are matched by the order in which ranks issue them, so a rank that
launched in readiness order could pair its bucket 2 with another rank's bucket 1.

[Note: gradient views] Each parameter's `.grad` is a view into its bucket's flat buffer.
Autograd accumulates into an existing `.grad` in place, so backward writes straight into the
buffer and the all-reduce runs on it with no copy in or out. `zero_grad(set_to_none=True)`
drops the views; the reducer re-attaches them (zeroed) at the next forward.

[Note: lazy buckets] A lazy bucket (ZeRO-2) holds no buffer between rounds: it allocates one
when its first gradient arrives in backward and `release`s it once the reduced shard has been
kept, so full gradients live only while their bucket is being filled and reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of the plan.

    index: launch position (0 launches first; see [Note: bucket order]).
    param_indices: positions, in the planned parameter list, of the parameters it holds.
    offsets: start of each parameter's gradient in the flat buffer (same order).
    numel: elements in the flat buffer, including padding.
    dtype: gradient dtype shared by all its parameters.
    device: device shared by all its parameters.
    group: the group (e.g. optimizer param group) shared by all its parameters.
    """

    index: int
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device
    group: int = 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_buckets(
    params: list[tuple],
    bucket_bytes: int,
    first_bucket_bytes: int | None = None,
    pad_to: int = 1,
) -> list[BucketSpec]:
    """Group parameters, given as (numel, dtype, device[, group]) in backward order, into buckets.

    A bucket closes once it holds at least `bucket_bytes` (the first one at
    `first_bucket_bytes`, so that communication starts early in backward). Parameters of
    different dtype, device or group (default 0; sharded strategies pass the optimizer param
    group, so a shard never mixes groups) never share a bucket. Each bucket's numel is padded
    up to a multiple of `pad_to` (the world size, for strategies that shard a bucket evenly).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes={bucket_bytes} must be > 0")
    if pad_to < 1:
        raise ValueError(f"plan_buckets: pad_to={pad_to} must be >= 1")
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed: list[tuple[tuple, list[int]]] = []
    for i, (numel, dtype, device, *group) in enumerate(params):
        key = (dtype, torch.device(device), group[0] if group else 0)
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + numel * dtype.itemsize
        cap = bucket_bytes if closed or first_bucket_bytes is None else first_bucket_bytes
        if open_bytes[key] >= cap:
            closed.append((key, open_buckets.pop(key)))
            open_bytes.pop(key)
    closed.extend(open_buckets.items())
    specs = []
    for index, ((dtype, device, group), members) in enumerate(closed):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i][0]
        specs.append(
            BucketSpec(
                index,
                tuple(members),
                tuple(offsets),
                _round_up(total, pad_to),
                dtype,
                device,
                group,
            )
        )
    return specs


class Bucket:
    """A flat gradient buffer shared by a few parameters, and its reduction in flight.

    Life cycle, once per synchronised backward: `attach_grads` (grads become views),
    `mark_ready` for each parameter as autograd finishes it, `launch` once all are ready,
    `wait` before the optimizer reads the gradients, `reset` for the next round.
    """

    def __init__(self, spec: BucketSpec, params: list[torch.nn.Parameter], lazy: bool = False):
        self.spec = spec
        self.index = spec.index
        self.params = params
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if not lazy:  # [Note: lazy buckets]
            self.allocate()
        self.pending = len(params)
        self.future: torch.futures.Future | None = None

    def allocate(self) -> None:
        """Create the zeroed flat buffer and the per-parameter views into it."""
        spec = self.spec
        self.buffer = torch.zeros(spec.numel, dtype=spec.dtype, device=spec.device)
        self.views = [
            self.buffer[off : off + p.numel()].view_as(p)
            for off, p in zip(spec.offsets, self.params, strict=True)
        ]

    def release(self) -> None:
        """Drop the buffer and the parameters' .grad views ([Note: lazy buckets])."""
        for param in self.params:
            param.grad = None
        self.buffer, self.views = None, []

    def attach_grads(self) -> list[bool]:
        """Point every parameter's .grad at its view; zero the views that had no grad.

        Returns, per parameter, whether its grad was None before (see [Note: unused parameters]).
        A lazy bucket with no buffer and no gradients stays empty.
        """
        if self.buffer is None:
            if all(p.grad is None for p in self.params):
                return [True] * len(self.params)
            self.allocate()
        was_none = []
        for param, view in zip(self.params, self.views, strict=True):
            grad = param.grad
            was_none.append(grad is None)
            if grad is None:
                view.zero_()
                param.grad = view
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                param.grad = view
        return was_none

    def adopt_grad(self, position: int) -> None:
        """Bring a grad that autograd replaced (create_graph, or no view yet) into the buffer."""
        if self.buffer is None:  # a lazy bucket's first gradient; later ones land in views
            self.allocate()
            self.attach_grads()
        param, view = self.params[position], self.views[position]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def mark_ready(self) -> bool:
        """Count one more parameter as finished; True when the whole bucket is."""
        self.pending -= 1
        return self.pending == 0

    def launch(self, hook, state) -> None:
        if self.buffer is None:
            self.allocate()  # nothing reached it on this rank: contribute zeros
        self.future = hook(state, self)

    def wait(self) -> None:
        if self.future is None:
            return
        result = self.future.wait()
        if isinstance(result, list):
            result = result[0]
        if result is not self.buffer and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result)
        self.future = None

    def reset(self) -> None:
        self.pending = len(self.params)
        self.future = None

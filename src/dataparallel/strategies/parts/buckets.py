"""Gradient buckets: a pure plan of which parameters share a flat buffer, and the bucket itself.

[Note: bucket order] Parameters are planned in *reverse* registration order, because backward
produces gradients roughly from the last layer to the first. Buckets are numbered in that order
and every rank launches them strictly by number (bucket i+1 never before bucket i): collectives
on one process group are matched by the order in which ranks issue them, so a rank that
launched in readiness order could pair its bucket 2 with another rank's bucket 1.

[Note: gradient views] After backward each parameter's `.grad` is a view into its bucket's
flat buffer: the all-reduce runs on the buffer in place and the optimizer reads the views, so
nothing is copied out of the bucket (PyTorch's DDP, by default, copies every gradient into its
bucket and back out). DDP, ZeRO-1/2 and ZeRO-3's units attach the views before backward and let
autograd add into them ([Note: attached views] in reducer.py); buckets of a wider dtype (and
ZeRO-3 units with a frozen parameter) adopt each gradient as follows:
- `.grad` exists (accumulation under `no_sync`, or `zero_grad(set_to_none=False)`): it is the
  view, and autograd adds into it in place: no copy at all.
- `.grad` is None (after the usual `zero_grad()`): autograd hands over a fresh tensor, and the
  post-accumulate-grad hook writes it into the view divided by the world size (`torch.div(...,
  out=view)`: the mean's division and the copy in one pass), then points `.grad` at the view.
  An earlier measurement put keeping the views attached (zeroed at each forward, autograd then
  adding into them) 7-12 ms of CPU behind this per gpt-small step (of ~340 ms); the attached
  path as built now ([Note: attached views]) measured level with this one on gpt-small (paired
  CPU 0.99-1.01x, benchmarks/bench_step.py --baseline da77e80, 2026-11-27) and took its place
  where the dtypes agree.
Each position of a bucket is EMPTY (no gradient yet this round), SCALED (divided) or RAW (a
local sum, divided at launch); at launch EMPTY positions become zeros ([Note: unused
parameters] in reducer.py).

[Note: lazy buckets] A lazy bucket (ZeRO-2) holds no buffer between rounds: it allocates one
when its first gradient arrives in backward and `release`s it once the reduced shard has been
kept, so full gradients live only while their bucket is being filled and reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MB = 1024 * 1024  # bucket sizes are given in MiB


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of the plan.

    index: launch position (0 launches first; see [Note: bucket order]).
    param_indices: positions, in the planned parameter list, of the parameters it holds.
    offsets: start of each parameter's gradient in the flat buffer (same order).
    numel: elements in the flat buffer, including padding.
    dtype: gradient dtype shared by all its parameters.
    device: device shared by all its parameters.
    group: the group (e.g. optimizer param group) shared by all its parameters; None for
        parameters in no optimizer's group (sharded strategies: not stepped).
    """

    index: int
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device
    group: int | None = 0


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


# What a bucket position holds in the current round ([Note: gradient views]).
EMPTY, SCALED, RAW = 0, 1, 2


class Bucket:
    """A flat gradient buffer shared by a few parameters, and its reduction in flight.

    What a communication hook sees ([Note: reduction interface] in comm/hooks.py): `index`
    (launch position), `buffer` (the flat gradients, already divided for the mean) and `shard`
    (None: reduce the whole buffer; (start, stop): this rank keeps only that slice, so the hook
    may reduce-scatter into it).

    Life cycle, once per synchronised backward: `attach_grads` before the forward,
    `adopt_grad` and `mark_ready` for each parameter as autograd finishes it, `launch` once all
    are ready (zeros for what never came, the mean's division for what is not divided yet),
    `wait` before the result is read, `reset` for the next round.

    divisor: the number of ranks averaged over (the bucket then holds this rank's gradient
        divided by it, so the hook only sums), 1 for a plain sum.
    lazy: hold no buffer between rounds ([Note: lazy buckets]).
    shard: this rank's [start, stop) of the buffer when only that slice is kept, or None.
    flat_shard: the optimizer's `FlatShard` that slice is reduced into (ZeRO-1/2; the stage's
        keeper moves it there, parts/keepers.py), or None.
    grad_views: whether the parameters' `.grad` are views into the buffer ([Note: gradient
        views]); only possible when the buffer has the parameters' dtype. Otherwise (a wider
        `reduce_dtype`) each gradient is added into the buffer and `.grad` goes back to None.
    """

    def __init__(
        self,
        spec: BucketSpec,
        params: list[torch.nn.Parameter],
        lazy: bool = False,
        divisor: int = 1,
        shard: tuple[int, int] | None = None,
        flat_shard=None,
    ):
        self.spec = spec
        self.flat_shard = flat_shard
        self.index = spec.index
        self.params = params
        self.divisor = divisor
        self.shard = shard
        self.grad_views = all(p.dtype == spec.dtype for p in params)
        self.end = spec.offsets[-1] + params[-1].numel() if params else 0  # padding from here
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.held: list[int] = [EMPTY] * len(params)  # per position: EMPTY, SCALED or RAW
        if not lazy:  # [Note: lazy buckets]
            self.allocate()
        self.pending = len(params)
        self.future = None

    def allocate(self) -> None:
        """Create the flat buffer (padding zeroed) and the per-parameter views into it."""
        spec = self.spec
        self.buffer = torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
        self.buffer[self.end :].zero_()  # padding: never written by a gradient, always reduced
        self.views = [
            self.buffer[off : off + p.numel()].view_as(p)
            for off, p in zip(spec.offsets, self.params, strict=True)
        ]
        self.held = [EMPTY] * len(self.params)

    def release(self) -> None:
        """Drop the buffer and the parameters' .grad views ([Note: lazy buckets])."""
        for param in self.params:
            param.grad = None
        self.buffer, self.views = None, []
        self.held = [EMPTY] * len(self.params)

    @property
    def shapes(self) -> list[tuple[int, torch.Size]]:
        """(offset in `buffer`, shape) of each parameter's gradient, for hooks that compress
        per matrix (PowerSGD)."""
        return [(off, p.shape) for off, p in zip(self.spec.offsets, self.params, strict=True)]

    def reduced(self) -> torch.Tensor:
        """What this rank keeps of the reduction: its shard of the buffer, or the whole."""
        if self.shard is None:
            return self.buffer
        return self.buffer[self.shard[0] : self.shard[1]]

    def attach_grads(self) -> list[bool]:
        """Before a forward: bring existing grads into the buffer; note which had none.

        A parameter without a grad keeps None: autograd hands over a fresh gradient, which
        `adopt_grad` copies into the view ([Note: gradient views]). Returns, per parameter,
        whether its grad was None (see [Note: unused parameters]).
        """
        was_none = [p.grad is None for p in self.params]
        if self.buffer is None:
            if all(was_none):
                return was_none
            self.allocate()
        for position, (param, view, none) in enumerate(
            zip(self.params, self.views, was_none, strict=True)
        ):
            if none:
                if self.grad_views:  # no grad: none accumulated (or zero_grad dropped it)
                    self.held[position] = EMPTY
                continue  # without views, `held` keeps what the buffer accumulated
            if param.grad.data_ptr() != view.data_ptr():
                if self.held[position] == EMPTY or self.grad_views:
                    view.copy_(param.grad)
                else:
                    view.add_(param.grad)
                param.grad = view if self.grad_views else None
            self.held[position] = RAW  # a local sum: autograd may add to it in place
        return was_none

    def attach_views(self) -> list[bool]:
        """Before a backward of the reducer's view path ([Note: attached views] in reducer.py):
        every `.grad` becomes its view, so autograd adds into the buffer in place; views of
        parameters without a grad are zeroed, an existing grad is copied in. Returns, per
        parameter, whether its grad was None ([Note: unused parameters] in reducer.py). A lazy
        bucket without any grad stays without a buffer until its first gradient."""
        was_none = [p.grad is None for p in self.params]
        if self.buffer is None:
            if all(was_none):
                return was_none
            self.allocate()
        if all(was_none):
            self.buffer[: self.end].zero_()
            for param, view in zip(self.params, self.views, strict=True):
                param.grad = view
        else:
            for param, view, none in zip(self.params, self.views, was_none, strict=True):
                if none:
                    view.zero_()
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                else:
                    continue
                param.grad = view
        self.held = [RAW] * len(self.params)  # local sums, divided at launch
        return was_none

    def keep_attached(self, position: int) -> None:
        """Before autograd adds a gradient on the view path: the parameter's `.grad` is its view
        again if it was cleared or replaced since the forward ([Note: cleared after the forward]
        in reducer.py)."""
        param, view = self.params[position], self.views[position]
        grad = param.grad
        if grad is not None and grad.data_ptr() == view.data_ptr():
            return
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        param.grad = view

    def allocate_attached(self) -> None:
        """A lazy bucket's first gradient on the view path: a zeroed buffer, its views as the
        parameters' `.grad`."""
        self.allocate()
        self.buffer.zero_()
        for param, view in zip(self.params, self.views, strict=True):
            param.grad = view
        self.held = [RAW] * len(self.params)

    def adopt_grad(self, position: int, divide: bool = True) -> None:
        """Bring the grad autograd just produced into the buffer.

        A fresh gradient into an empty view is copied, divided by `divisor` in the same pass
        when `divide` (a synchronised backward); a grad autograd accumulated into the view in
        place needs nothing now (it is divided at launch).
        """
        if self.buffer is None:  # a lazy bucket's first gradient
            self.allocate()
        param, view = self.params[position], self.views[position]
        grad = param.grad
        if grad is None or grad.data_ptr() == view.data_ptr():
            return
        held = self.held[position]
        if held == EMPTY and divide and self.divisor != 1:
            if grad.dtype == view.dtype:
                torch.div(grad, self.divisor, out=view)  # the division and the copy in one pass
            else:  # widen first, then divide in the bucket's precision
                view.copy_(grad).div_(self.divisor)
            self.held[position] = SCALED
        elif held == EMPTY or self.grad_views:
            # a first gradient without division, or one autograd rebuilt (create_graph: it
            # already holds what the view held)
            view.copy_(grad)
            self.held[position] = RAW
        else:  # the buffer accumulates, .grad does not: add this backward's gradient
            view.add_(grad, alpha=1.0 / self.divisor if held == SCALED else 1.0)
        param.grad = view if self.grad_views else None

    def complete(self) -> None:
        """Before the reduction: zeros for parameters that got no gradient this round; the
        division by `divisor` for what holds a local sum."""
        if self.buffer is None:
            self.allocate()
        elif self.end < self.spec.numel:  # [Note: finite padding] in flat_shard.py
            self.buffer[self.end :].zero_()
        if all(h == RAW for h in self.held):
            if self.divisor != 1:
                self.buffer.div_(self.divisor)  # one pass (the padding is zero)
            self.held = [SCALED] * len(self.params)
            return
        for position, held in enumerate(self.held):
            view = self.views[position]
            if held == EMPTY:
                view.zero_()
                if self.grad_views:
                    self.params[position].grad = view
            elif held == RAW and self.divisor != 1:
                view.div_(self.divisor)
            self.held[position] = SCALED

    def mark_ready(self) -> bool:
        """Count one more parameter as finished; True when the whole bucket is."""
        self.pending -= 1
        return self.pending == 0

    def launch(self, hook, state) -> None:
        self.complete()
        self.future = hook(state, self)

    def wait(self) -> None:
        """Wait for the hook's result and bring it into the buffer (or the shard) if it is
        not there already."""
        if self.future is None:
            return
        result = self.future.wait()
        if isinstance(result, list):
            result = result[0]
        target = self.buffer if result.numel() == self.buffer.numel() else self.reduced()
        if result.data_ptr() != target.data_ptr():
            target.copy_(result.view(-1))
        self.future = None

    def reset(self) -> None:
        """After a synchronised round: nothing accumulated any more."""
        self.pending = len(self.params)
        self.future = None
        if not self.grad_views:
            self.held = [EMPTY] * len(self.params)

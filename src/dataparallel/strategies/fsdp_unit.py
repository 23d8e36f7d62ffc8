"""One ZeRO-3 unit: a flat sharded parameter, its gather and free, its gradient reduction.

[Note: flat layout] A unit's parameters are concatenated, in registration order, into one
flat buffer padded with zeros to a multiple of the world size; rank r keeps elements
[r * S, (r + 1) * S) as its shard (S = padded / world_size). A parameter may straddle two
shards, and the padding lives in the last ones: any size is accepted, none is refused. The
optimizer sees, per rank, one *piece* per parameter: an nn.Parameter that is a view of the
part of the shard that parameter covers (`FlatLayout.local_slice`). The user's param groups
are therefore kept as they are, and an elementwise optimizer updates exactly what it would
update on the whole parameter.

[Note: parameters at rest] Each model parameter keeps its identity, shape and dtype. While its
unit is gathered, its `.data` is a view of the unit's gathered buffer; the buffer is freed by
resizing its storage to zero, so tensors that autograd saved in forward (views of the weights)
point into the same storage and see the regathered values in backward without holding memory
in between. At rest `.data` is a one-element NaN expanded to the parameter's shape: reading a
parameter outside its unit's forward gives NaN (not a crash), writing to it raises. Use
`dp.full_state_dict(model)` to read weights.

[Note: gradient views] A unit's gradients land in one flat buffer in the compute dtype, which
the reduction reads with no copy: autograd's fresh gradient of each parameter is copied into its
view as it is accumulated (one pass, cheaper than zeroing the views beforehand and letting
autograd add into them), and gradients that exist already (`no_sync`) are views that autograd
accumulates into in place. After the reduction the views are dropped; the averaged shard
goes into a fp32 gradient shard whose slices are the pieces' `.grad`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from .fsdp_plan import UnitPlan


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a unit lies in the flat buffer and in every rank's shard.

    numels: elements of each parameter, in flat order.
    offsets: start of each parameter in the flat buffer.
    world_size: number of shards.
    shard_numel: elements each rank holds; the flat buffer has world_size * shard_numel
        elements and ends in zero padding when the total does not divide.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int
    shard_numel: int

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def local_slice(self, index: int, rank: int) -> tuple[int, int, int]:
        """(start, stop) of parameter `index` within rank's shard, and where that part starts
        within the parameter; (0, 0, 0) when the parameter has nothing on that rank."""
        shard_start = rank * self.shard_numel
        lo = max(self.offsets[index], shard_start)
        hi = min(self.offsets[index] + self.numels[index], shard_start + self.shard_numel)
        if hi <= lo:
            return 0, 0, 0
        return lo - shard_start, hi - shard_start, lo - self.offsets[index]


def plan_flat(numels: list[int], world_size: int) -> FlatLayout:
    """The flat layout of parameters with `numels` elements over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"plan_flat: world_size={world_size} must be >= 1")
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    return FlatLayout(tuple(numels), tuple(offsets), world_size, math.ceil(total / world_size))


class FlatUnit:
    """The parameters of one module, flattened and sharded across the ranks.

    Life cycle of a step: `start_gather` (ahead of time, when prefetching) and `gather` before
    the forward; `free` after it; `gather` and `prepare_grads` before the backward;
    `start_reduce` after it, then `finish_reduce`, `attach_grads` once the backward is over.
    """

    def __init__(self, index: int, plan: UnitPlan, comm: Comm, param_dtype, reduce: str):
        self.index, self.name, self.module = index, plan.name or "<root>", plan.module
        self.params = list(plan.params)
        self.comm = comm
        self.reduce_kind = reduce
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) > 1:
            raise ValueError(
                f"ZeRO3: unit '{self.name}' mixes parameter dtypes {dtypes}; give its "
                "parameters one dtype or wrap them in different units"
            )
        first = self.params[0] if self.params else None
        self.dtype = first.dtype if first is not None else torch.float32  # master weights
        self.device = first.device if first is not None else comm.device
        self.compute_dtype = param_dtype or self.dtype
        self.shapes = [p.shape for p in self.params]
        self.layout = plan_flat([p.numel() for p in self.params], comm.world_size)
        rank, size = comm.rank, self.layout.shard_numel
        with torch.no_grad():
            flat = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
            for p, off in zip(self.params, self.layout.offsets, strict=True):
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            self.shard = flat[rank * size : (rank + 1) * size].clone()
        self.pieces: list[nn.Parameter | None] = []
        for i, p in enumerate(self.params):
            start, stop, _ = self.layout.local_slice(i, rank)
            piece = nn.Parameter(self.shard[start:stop], requires_grad=p.requires_grad)
            self.pieces.append(piece if stop > start else None)
        self.full = self._flat_buffer(self.compute_dtype)
        self.views = self._views_of(self.full)
        self.full.untyped_storage().resize_(0)
        self.nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            p.data = self.nan.expand(p.shape)  # [Note: parameters at rest]
        self.state = "free"  # "free" -> "gathering" -> "gathered" -> "free"
        self._gather_work = None
        self._gather_source: torch.Tensor | None = None
        self.largest_gathered = 0
        self.forward_count = 0
        self.grad_full: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []
        self.grad_filled: list[bool] = []
        self.used = [False] * len(self.params)
        self.reduced = False
        self._reduce = None
        self._grad_shard_ref = None  # weak: the pieces' .grad keep the gradient shard alive
        self._new_grad_shard: torch.Tensor | None = None

    def _flat_buffer(self, dtype) -> torch.Tensor:
        return torch.empty(self.layout.padded_numel, dtype=dtype, device=self.device)

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[off : off + p.numel()].view(shape)
            for p, off, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True)
        ]

    @property
    def empty(self) -> bool:
        return self.layout.padded_numel == 0

    # -- parameters -------------------------------------------------------------------------
    def start_gather(self, prefetch: bool = False) -> None:
        """Start the all-gather of the shards into the unit's buffer (no-op if under way)."""
        if self.state != "free" or self.empty:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.largest_gathered = max(self.largest_gathered, self.full.untyped_storage().nbytes())
        source = self.shard.detach()
        if self.compute_dtype != self.dtype:
            source = source.to(self.compute_dtype)  # [Note: mixed precision] in fsdp.py
        self.comm.tracer.mark("gather_start", unit=self.index, prefetch=prefetch)
        if self.comm.world_size == 1:
            self.full.copy_(source)
        else:
            self._gather_work = self.comm.all_gather(self.full, source, async_op=True)
            self._gather_source = source  # alive until the collective has read it
        self.state = "gathering"

    def gather(self) -> None:
        """Make the parameters usable: finish (or start and finish) the gather, point them at it."""
        if self.state == "gathered" or self.empty:
            return
        self.start_gather()
        if self._gather_work is not None:
            self.comm.tracer.mark("gather_wait", unit=self.index)
            self._gather_work.wait()
        self._gather_work = self._gather_source = None
        self.comm.tracer.mark("gather_end", unit=self.index)
        for p, view in zip(self.params, self.views, strict=True):
            p.data = view
        self.state = "gathered"

    def free(self) -> None:
        """Release the gathered buffer; the parameters go back to rest."""
        if self.state == "free":
            return
        if self._gather_work is not None:
            self._gather_work.wait()  # never free a buffer a collective still writes
        self._gather_work = self._gather_source = None
        for p in self.params:
            p.data = self.nan.expand(p.shape)
        self.full.untyped_storage().resize_(0)
        self.state = "free"

    # -- gradients --------------------------------------------------------------------------
    def _ensure_grad_buffer(self) -> None:
        """Allocate the flat gradient buffer (padding zeroed) and its views, once per round."""
        if self.grad_full is None:
            self.grad_full = self._flat_buffer(self.compute_dtype)
            self.grad_full[sum(self.layout.numels) :].zero_()
            self.grad_views = self._views_of(self.grad_full)
            self.grad_filled = [False] * len(self.params)

    def prepare_grads(self) -> None:
        """Before the unit's backward: bring gradients that exist into the flat buffer (kept
        across `no_sync` backwards, where it accumulates); a parameter without one gets it
        from autograd and `on_grad_accumulated` copies it in ([Note: gradient views])."""
        if self.empty:
            return
        self._ensure_grad_buffer()
        for position, p in enumerate(self.params):
            if p.requires_grad and p.grad is not None:
                self._adopt(position, p)

    def _adopt(self, position: int, p: torch.Tensor) -> None:
        view = self.grad_views[position]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self.grad_filled[position] = True

    def start_reduce(self) -> None:
        """Start averaging the unit's gradients across ranks; drop the parameters' .grad."""
        self.reduced = True
        if self.empty:
            return
        self._ensure_grad_buffer()
        flat = self.grad_full
        for position, (p, view) in enumerate(zip(self.params, self.grad_views, strict=True)):
            if p.grad is not None:
                self._adopt(position, p)  # autograd replaced the view (e.g. create_graph)
            if not self.grad_filled[position]:
                view.zero_()  # no gradient reached it on this rank: contribute zeros
            p.grad = None
        self.grad_full, self.grad_views = None, []
        n, size, rank = self.comm.world_size, self.layout.shard_numel, self.comm.rank
        work = None
        if n > 1:
            if self.compute_dtype != self.dtype:
                flat.div_(n)  # low precision: average before summing, so the sum cannot overflow
            self.comm.tracer.mark("reduce_start", unit=self.index, kind=self.reduce_kind)
            out = flat[rank * size : (rank + 1) * size]  # this rank's part, reduced in place
            if self.reduce_kind == "reduce_scatter":
                work = self.comm.reduce_scatter(out, flat, async_op=True)
            else:
                work = self.comm.all_reduce(flat, async_op=True)
        else:
            out = flat
        self._reduce = (work, flat, out)

    def finish_reduce(self) -> None:
        """Wait for the reduction and add this rank's averaged part into the gradient shard."""
        if self._reduce is None:
            return
        work, _flat, out = self._reduce
        self._reduce = None
        if work is not None:
            work.wait()
            self.comm.tracer.mark("reduce_end", unit=self.index)
        divide = self.comm.world_size if self.compute_dtype == self.dtype else 1
        grad_shard = self._grad_shard_ref() if self._grad_shard_ref is not None else None
        if grad_shard is None:
            grad_shard = torch.empty(out.numel(), dtype=self.dtype, device=out.device)
            torch.div(out, divide, out=grad_shard)  # one pass: average, cast, copy out
            self._grad_shard_ref = weakref.ref(grad_shard)
        else:
            # Reused because some piece still holds its .grad (accumulation across steps). Pieces
            # whose .grad was cleared start again from zero, or they would inherit old values.
            for i, piece in enumerate(self.pieces):
                if piece is not None and piece.grad is None:
                    start, stop, _ = self.layout.local_slice(i, self.comm.rank)
                    grad_shard[start:stop].zero_()
            grad_shard.add_(out.to(self.dtype), alpha=1.0 / divide)
        self._new_grad_shard = grad_shard

    def attach_grads(self, used: list[bool]) -> None:
        """Give each piece its slice of the gradient shard as .grad, unless the parameter was
        used by no rank and had no gradient before (then it stays None, as in one process)."""
        grad_shard = self._new_grad_shard
        self._new_grad_shard = None
        if grad_shard is None:
            return
        for i, piece in enumerate(self.pieces):
            if piece is None or not piece.requires_grad or piece.grad is not None:
                continue
            if used[i]:
                start, stop, _ = self.layout.local_slice(i, self.comm.rank)
                piece.grad = grad_shard[start:stop]

    def end_round(self) -> None:
        self.used = [False] * len(self.params)
        self.reduced = False
        self.forward_count = 0

    def on_grad_accumulated(self, position: int, param: torch.Tensor) -> None:
        if self.reduced:
            raise RuntimeError(
                f"ZeRO3: a gradient of unit '{self.name}' arrived after the unit was reduced; "
                "does a module outside the unit use its parameters? wrap differently"
            )
        self.used[position] = True
        self._ensure_grad_buffer()
        self._adopt(position, param)

    # -- what this rank holds ---------------------------------------------------------------
    def piece_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.pieces if p is not None and p.grad is not None]

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameter storages, gradient storages) this unit holds right now."""
        params = [self.shard, self.full]
        grads = self.piece_grads() + [p.grad for p in self.params if p.grad is not None]
        if self.grad_full is not None:
            grads.append(self.grad_full)
        return params, grads

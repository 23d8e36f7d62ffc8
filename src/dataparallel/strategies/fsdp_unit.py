"""One ZeRO-3 unit: a flat sharded parameter, its gather and free, its gradient reduction.

[Note: flat layout] A unit's parameters are concatenated, in registration order, into one
flat buffer padded with zeros to a multiple of the shard group's size ([Note: shard layout] in
parts/layout.py); rank r of the group keeps the r-th slice as its `FlatShard` ([Note: flat
shard] in parts/flat_shard.py), whose pieces the optimizer steps. A parameter may straddle
two shards, and the padding lives in the last ones: any size is accepted, none is refused.

[Note: parameters at rest] Each model parameter keeps its identity, shape and dtype. While its
unit is gathered, its `.data` is a view of the unit's gathered buffer; the buffer is freed by
resizing its storage to zero, so tensors that autograd saved in forward (views of the weights)
point into the same storage and see the regathered values in backward without holding memory
in between. At rest `.data` is a one-element NaN expanded to the parameter's shape: reading a
parameter outside its unit's forward gives NaN (not a crash), writing to it raises. Use
`dp.full_state_dict(model)` to read weights.

Gradients: a unit's gradients land in a lazy `Bucket` (parts/buckets.py, the same one ZeRO-1/2
and DDP use: divided for the mean as they are copied in, views autograd accumulates into under
`no_sync`), which the strategy's hook reduces to this rank's shard ([Note: reduction interface]
in comm/hooks.py); the shard keeps the result in its dtype (fp32 under mixed precision) and the
bucket is freed, as ZeRO-2 does with its buckets.
"""

from __future__ import annotations

import torch

from ..comm import Comm, HookState
from .fsdp_plan import UnitPlan
from .parts.buckets import Bucket, BucketSpec
from .parts.flat_shard import FlatShard
from .parts.layout import ShardLayout


class FlatUnit:
    """The parameters of one module, flattened and sharded across the shard group.

    Life cycle of a step: `start_gather` (ahead of time, when prefetching) and `gather` before
    the forward; `free` after it; `gather` and `prepare_grads` before the backward;
    `start_reduce` after it, then `finish_reduce`; `end_round` once the backward is over.

    compute_dtype: the dtype gathered parameters and their gradients are in.
    bucket_dtype: the dtype gradients are accumulated and reduced in.
    divisor: ranks the mean divides by (every rank, replicas included).
    """

    def __init__(
        self,
        index: int,
        plan: UnitPlan,
        comm: Comm,
        compute_dtype: torch.dtype | None,
        bucket_dtype: torch.dtype | None,
        divisor: int,
    ):
        self.index, self.name, self.module = index, plan.name or "<root>", plan.module
        self.params = list(plan.params)
        self.comm = comm
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) > 1:
            raise ValueError(
                f"ZeRO3: unit '{self.name}' mixes parameter dtypes {dtypes}; give its "
                "parameters one dtype or wrap them in different units"
            )
        first = self.params[0] if self.params else None
        self.dtype = first.dtype if first is not None else torch.float32  # master weights
        self.device = first.device if first is not None else comm.device
        self.compute_dtype = compute_dtype or self.dtype
        self.shapes = [p.shape for p in self.params]
        self.layout = ShardLayout.pack([p.numel() for p in self.params], comm.world_size)
        rank, size = comm.rank, self.layout.shard_numel
        with torch.no_grad():
            flat = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
            for p, off in zip(self.params, self.layout.offsets, strict=True):
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            data = flat[rank * size : (rank + 1) * size].clone()
        self.shard = FlatShard(self.layout, rank, data, [p.requires_grad for p in self.params])
        self.full = self._flat_buffer(self.compute_dtype)
        self.views = self._views_of(self.full)
        self.full.untyped_storage().resize_(0)
        self.nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            p.data = self.nan.expand(p.shape)  # [Note: parameters at rest]
        spec = BucketSpec(
            index,
            tuple(range(len(self.params))),
            self.layout.offsets,
            self.layout.numel,
            bucket_dtype or self.compute_dtype,
            self.device,
        )
        self.bucket = Bucket(spec, self.params, True, divisor, self.layout.shard_range(rank))
        self.state = "free"  # "free" -> "gathering" -> "gathered" -> "free"
        self._gather_work = None
        self._gather_source: torch.Tensor | None = None
        self.largest_gathered = 0
        self.forward_count = 0
        self.grads_attached = False
        self.reduced = False
        self.reducing = False

    def _flat_buffer(self, dtype) -> torch.Tensor:
        return torch.empty(self.layout.numel, dtype=dtype, device=self.device)

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[off : off + p.numel()].view(shape)
            for p, off, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True)
        ]

    @property
    def empty(self) -> bool:
        return self.layout.numel == 0

    @property
    def pieces(self) -> list:
        return self.shard.pieces

    # -- parameters -------------------------------------------------------------------------
    def start_gather(self, prefetch: bool = False) -> None:
        """Start the all-gather of the shards into the unit's buffer (no-op if under way)."""
        if self.state != "free" or self.empty:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.largest_gathered = max(self.largest_gathered, self.full.untyped_storage().nbytes())
        source = self.shard.data.detach()
        if self.compute_dtype != self.dtype:
            source = source.to(self.compute_dtype)  # [Note: mixed precision]
        self.comm.tracer.mark("gather_start", unit=self.index, prefetch=prefetch)
        if self.comm.world_size == 1:
            self.full.copy_(source)
        else:
            with self.comm.tracer.labelled(unit=self.index):
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
    def prepare_grads(self) -> None:
        """Before the unit's first backward of a round: gradients that exist (kept across
        `no_sync` backwards) come into the bucket; fresh ones arrive in `on_grad_accumulated`."""
        if self.empty or self.grads_attached:
            return
        self.grads_attached = True
        if any(p.grad is not None for p in self.params):
            self.bucket.attach_grads()

    def on_grad_accumulated(self, position: int, divide: bool) -> None:
        if self.reduced:
            raise RuntimeError(
                f"ZeRO3: a gradient of unit '{self.name}' arrived after the unit was reduced; "
                "does a module outside the unit use its parameters? wrap differently"
            )
        self.bucket.adopt_grad(position, divide=divide)

    def start_reduce(self, hook, state: HookState) -> None:
        """Start reducing the unit's gradients to this rank's shard ([Note: reduction
        interface]); the parameters' .grad are dropped (the shard will hold the result)."""
        self.reduced = True
        if self.empty:
            return
        self.comm.tracer.mark("reduce_start", unit=self.index)
        with self.comm.tracer.labelled(unit=self.index):
            self.bucket.launch(hook, state)
        for p in self.params:
            p.grad = None
        self.reducing = True

    def finish_reduce(self) -> None:
        """Wait for the reduction and add this rank's averaged part into the shard's gradient."""
        if not self.reducing:
            return
        self.reducing = False
        self.bucket.wait()
        self.comm.tracer.mark("reduce_end", unit=self.index)
        self.shard.take_reduced(self.bucket.reduced())
        self.bucket.release()
        self.bucket.reset()

    def end_round(self, used: list[bool]) -> None:
        """The round is over: pieces of parameters some rank used get their .grad."""
        self.shard.attach_grads(used)
        self.reduced = False
        self.forward_count = 0
        self.grads_attached = False

    # -- what this rank holds ---------------------------------------------------------------
    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameter storages, gradient storages) this unit holds right now."""
        params = [self.shard.data, self.full]
        grads = [self.shard.store] + [p.grad for p in self.params if p.grad is not None]
        if self.bucket.buffer is not None:
            grads.append(self.bucket.buffer)
        return params, grads

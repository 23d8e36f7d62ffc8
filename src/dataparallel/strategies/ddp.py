"""DDP: every rank holds the whole model; gradients are all-reduced bucket by bucket in backward.

The contract (what `parallelize(model, DDP(...))` guarantees):
- At wrap time every rank checks it holds the same parameter names, shapes and dtypes (one
  clear error on all ranks otherwise), then takes rank 0's parameters and buffers.
- After `loss.backward()` returns, every `.grad` holds the mean (or sum) across ranks, reduced
  in buckets that overlap backward ([Note: overlap] in reducer.py); grads are views into the
  flat buckets ([Note: gradient views] in buckets.py), so no copy is made per step. The
  parameters are laid out the same way ([Note: laid parameters]), so that an elementwise
  optimizer from `build_optimizer` steps each bucket's as one tensor ([Note: flat step]).
- Inside `no_sync()` gradients accumulate locally; the first backward outside it reduces the
  accumulated sum, so k micro-steps equal one step on the k-times batch.
- Unused parameters are detected automatically ([Note: unused parameters] in reducer.py).
- With `broadcast_buffers`, buffers (BatchNorm statistics) are broadcast from rank 0 at the
  start of each training forward (only in `train()` mode with grad enabled, so an evaluation
  that runs on one rank alone never waits for the others).
- `precision=MixedPrecision(...)` ([Note: mixed precision] in parts/precision.py): with a
  `param_dtype` narrower than the model's, the parameters are held in it and fp32 masters with
  the optimizer state beside them: that is ZeRO-1 on shard groups of one rank (a 2-D mesh with
  S = 1, [Note: mesh]), and that is what `parallelize` builds (strategies/resolve.py). The reduced gradients are then the
  masters' `.grad`, not the model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..comm import Comm, HookState
from ..comm.hooks import default_hook
from .base import (
    Strategy,
    broadcast_buffers,
    broadcast_model,
    check_optimizer_params,
    normalize_param_groups,
    verify_same_model,
)
from .parts.buckets import MB, Bucket, plan_buckets
from .parts.clip import clip_replicated_
from .parts.footprint import Footprint, bucketed
from .parts.geometry import Geometry, build_geometry, optimized_ids
from .parts.mesh import Groups
from .parts.opaque import opaque
from .parts.owners import check_not_tensor_parallel
from .parts.precision import MixedPrecision, check_precision, install_casts
from .parts.reducer import GradientReducer


@torch.no_grad()
def lay_like(bucket: Bucket) -> None:
    """[Note: laid parameters] The bucket's parameters become views of one flat buffer laid out
    as the bucket's gradients are: each run of them is then stepped as one tensor by an
    elementwise optimizer ([Note: flat step] in parts/flat_step.py). Same bytes (each
    parameter's own memory is freed), same values; only buckets whose gradients are views of
    the bucket and whose parameters are plain contiguous tensors (a tensor-parallel DTensor
    keeps its own). Re-laid buckets ([Note: arrival order] in parts/reducer.py) lay them
    again."""
    params = bucket.params
    if not bucket.grad_views or not params:
        return
    if any(type(p) is not nn.Parameter or not p.is_contiguous() for p in params):
        return
    spec = bucket.spec
    flat = torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
    for param, offset in zip(params, spec.offsets, strict=True):
        view = flat[offset : offset + param.numel()].view_as(param)
        view.copy_(param)
        param.data = view


@dataclass(frozen=True, kw_only=True)
class DDP:
    """Policy for replicated data parallelism.

    bucket_mb: gradient bucket size in MiB; larger buckets mean fewer, bigger collectives and
        less overlap. Must be > 0.
    first_bucket_mb: size of the first bucket (the last layers' gradients), kept small so the
        first all-reduce starts early in backward. Must be > 0.
    reduce_op: "mean" averages gradients across ranks (N-rank training equals one rank on the
        N-times batch); "sum" adds them.
    broadcast_buffers: broadcast buffers from rank 0 at each training forward.
    comm_hook: `hook(state, bucket) -> future` that reduces one bucket ([Note: reduction
        interface] in comm/hooks.py); None is the plain all-reduce (in `reduce_dtype` when the
        precision policy names a narrower one). `dataparallel.comm.bf16_compress_hook` halves
        the bytes.
    hook_state: the state passed to `comm_hook`; None builds a `HookState` for the group.
    precision: a `MixedPrecision` ([Note: mixed precision]); None computes in the model's dtype
        (held as `MixedPrecision()` once the policy is made: [Note: full precision]).
    """

    name: ClassVar[str] = "ddp"
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    reduce_op: str = "mean"
    broadcast_buffers: bool = True
    comm_hook: Callable | None = None
    hook_state: object | None = None
    precision: MixedPrecision | None = None

    def __post_init__(self):
        if not self.bucket_mb > 0:
            raise ValueError(f"DDP: bucket_mb={self.bucket_mb} must be > 0 (MiB per bucket)")
        if not self.first_bucket_mb > 0:
            raise ValueError(f"DDP: first_bucket_mb={self.first_bucket_mb} must be > 0")
        if self.reduce_op not in ("mean", "sum"):
            raise ValueError(f"DDP: reduce_op={self.reduce_op!r} must be 'mean' or 'sum'")
        object.__setattr__(self, "precision", check_precision(self.precision, "DDP"))

    def apply(self, model: nn.Module, groups: Groups) -> Strategy:
        self.check_groups(groups)
        return DDPStrategy(model, groups.world, self)

    def check_groups(self, groups: Groups) -> None:
        if groups.shard is not groups.world:
            raise ValueError(
                "parallelize: DDP replicates every parameter, so a mesh with shard_size > 1 "
                "means nothing to it; use zero1, zero2 or zero3 with the mesh"
            )

    def footprint(self, shapes, *, model_dtype=torch.float32, **given) -> Footprint:
        """Bytes one rank holds ([Note: footprint] in parts/footprint.py; `given`: `bucketed`'s
        optimizer_bytes, rank); with a low `param_dtype`, ZeRO-1's on shard groups of one rank,
        as policy resolution builds it (strategies/resolve.py)."""
        masters = self.precision.masters(model_dtype) is not None
        return bucketed(
            shapes,
            self.precision,
            stage=1 if masters else 0,
            shards=1,
            in_flight=1,
            bucket_bytes=(int(self.bucket_mb * MB), int(self.first_bucket_mb * MB)),
            pairwise=False,
            model_dtype=model_dtype,
            **given,
        )


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, model: nn.Module, comm: Comm, policy: DDP):
        super().__init__(model, comm)
        self.policy = policy
        verify_same_model(model, comm)
        broadcast_model(model, comm)
        precision = policy.precision
        trainable = [p for p in model.parameters() if p.requires_grad]
        planned = list(reversed(trainable))  # [Note: bucket order]
        dtype = planned[0].dtype if planned else torch.float32
        if precision.bucket_dtype(dtype) != dtype:
            raise ValueError(
                f"DDP: reduce_dtype={precision.reduce_dtype} is wider than the parameters "
                f"({dtype}); hold them in it and set param_dtype={dtype} for masters, or drop "
                "reduce_dtype"
            )
        self.hook = policy.comm_hook or default_hook("all_reduce", precision.wire_dtype(dtype))
        self.hook_state = policy.hook_state or HookState(comm)
        self.reducer = self._build_reducer(planned, record_arrival=True)
        self.casts = install_casts(model, precision, dtype, dtype)
        self.buffers = [b for b in model.buffers()]
        self._pre_hook = model.register_forward_pre_hook(opaque(self._before_forward))

    def _build_reducer(self, planned: list[nn.Parameter], record_arrival: bool) -> GradientReducer:
        policy = self.policy
        specs = plan_buckets(
            [(p.numel(), p.dtype, p.device) for p in planned],
            bucket_bytes=int(policy.bucket_mb * MB),
            first_bucket_bytes=int(policy.first_bucket_mb * MB),
        )
        reducer = GradientReducer(
            planned,
            specs,
            self.comm,
            self.hook,
            self.hook_state,
            divisor=self.comm.world_size if policy.reduce_op == "mean" else 1,
            record_arrival=record_arrival,
        )
        reducer.sync_enabled = self.sync_enabled
        for bucket in reducer.buckets:
            lay_like(bucket)
        return reducer

    def _relay_buckets(self, order: list[int]) -> None:
        """Once the first synchronised backward is over ([Note: arrival order] in
        parts/reducer.py): buckets in the order its gradients arrived on rank 0 (every rank
        takes rank 0's, so that bucket i holds the same parameters everywhere). The next
        `prepare` moves any kept gradient into the new buckets."""
        if self.comm.world_size > 1:
            agreed = torch.tensor(order, dtype=torch.int64, device=self.comm.device)
            with self.comm.tracer.labelled(what="bucket order"):  # once: not the step's traffic
                self.comm.broadcast(agreed, src=0)
            order = agreed.tolist()
        if order == list(range(len(order))):
            return
        planned = [self.reducer.params[i] for i in order]
        self.reducer.remove()
        self.reducer = self._build_reducer(planned, record_arrival=False)

    def _before_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            if self.reducer.arrival_order is not None:
                order, self.reducer.arrival_order = self.reducer.arrival_order, None
                self._relay_buckets(order)
            self.reducer.prepare()
            if self.policy.broadcast_buffers:
                broadcast_buffers(module, self.buffers, self.comm)

    def build_optimizer(
        self, optimizer_cls, params=None, *, reads: str | list[str] = "element", **kwargs
    ) -> torch.optim.Optimizer:
        # Every rank steps whole parameters: every layout is this one, except over a
        # tensor-parallel parameter, whose local tensor is a slice ([Note: optimizer layout]).
        groups = normalize_param_groups(self.model, params)
        per_group = reads if isinstance(reads, list) else [reads] * len(groups)
        picked = [g["params"] for g, r in zip(groups, per_group, strict=True) if r != "element"]
        check_not_tensor_parallel(picked, optimizer_cls.__name__)
        return optimizer_cls(groups, **kwargs)

    def rebind(self, group) -> None:
        """Every rank holds the whole model: only the group, and the mean's divisor, change. A
        reduction that failed half-way is dropped (the caller drops the gradients too)."""
        self.comm.rebind(group)
        mean = self.policy.reduce_op == "mean"
        self.reducer.rebind(divisor=self.comm.world_size if mean else 1)
        # [Note: arrival order] in parts/reducer.py, after a rebind: the new group may hold a
        # process fresh from `parallelize` (a live run's replacement), whose buckets are still
        # the planned ones: every member starts again from them and settles the arrival order
        # with the others, at the same forward. Without this the survivors' re-laid buckets met the replacement's planned
        # ones in one step's all-reduces (tests/e2e/test_live_recovery.py: 2.6e-3 off).
        planned = list(reversed([p for p in self.model.parameters() if p.requires_grad]))
        same = [id(p) for p in self.reducer.params] == [id(p) for p in planned]
        if not same or self.reducer.arrival is None:
            self.reducer.remove()
            self.reducer = self._build_reducer(planned, record_arrival=True)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_optimizer_params(self.model, optimizer.param_groups)
        return optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        # After backward every rank holds the same reduced gradients: the local norm is global
        # (over "dp"; tensor-parallel parameters' norms are summed over "tp").
        return clip_replicated_(list(self.model.parameters()), max_norm, norm_type)

    def geometry(self, optimizer: torch.optim.Optimizer | None = None) -> Geometry:
        """Every parameter whole, stepped as itself ([Note: geometry])."""
        return build_geometry(self.model, [], None, optimized_ids(optimizer))

    def working_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [p.data for p in self.model.parameters()]
        return params, [b.buffer for b in self.reducer.buckets]

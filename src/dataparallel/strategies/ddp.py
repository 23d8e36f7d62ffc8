"""DDP: every rank holds the whole model; gradients are all-reduced bucket by bucket in backward.

The contract (what `parallelize(model, DDP(...))` guarantees):
- At wrap time every rank checks it holds the same parameter names, shapes and dtypes (one
  clear error on all ranks otherwise), then takes rank 0's parameters and buffers.
- After `loss.backward()` returns, every `.grad` holds the mean (or sum) across ranks, reduced
  in buckets that overlap backward ([Note: overlap] in reducer.py); grads are views into the
  flat buckets ([Note: gradient views] in buckets.py), so no copy is made per step.
- Inside `no_sync()` gradients accumulate locally; the first backward outside it reduces the
  accumulated sum, so k micro-steps equal one step on the k-times batch.
- Unused parameters are detected automatically ([Note: unused parameters] in reducer.py).
- With `broadcast_buffers`, buffers (BatchNorm statistics) are broadcast from rank 0 at the
  start of each training forward (only in `train()` mode with grad enabled, so an evaluation
  that runs on one rank alone never waits for the others).
- `precision=MixedPrecision(...)` ([Note: mixed precision] in parts/precision.py): with a
  `param_dtype` narrower than the model's, the parameters are held in it and fp32 masters with
  the optimizer state beside them: that is ZeRO-1 on shard groups of one rank (a 2-D mesh with
  S = 1, [Note: mesh]), and DDP builds exactly that. The reduced gradients are then the
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
    check_optimizer_params,
    hook_state_report,
    normalize_param_groups,
    optimizer_state_tensors,
    tensor_bytes,
    verify_same_model,
)
from .parts.buckets import plan_buckets
from .parts.footprint import Footprint, bucketed
from .parts.mesh import Groups, init_mesh
from .parts.precision import MixedPrecision, check_precision, install_casts
from .parts.reducer import GradientReducer

MB = 1024 * 1024


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
    precision: a `MixedPrecision` ([Note: mixed precision]); None computes in the model's dtype.
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
        check_precision(self.precision, "DDP")

    def apply(self, model: nn.Module, groups: Groups) -> Strategy:
        if groups.shard is not groups.world:
            raise ValueError(
                "parallelize: DDP replicates every parameter, so a mesh with shard_size > 1 "
                "means nothing to it; use zero1, zero2 or zero3 with the mesh"
            )
        precision = check_precision(self.precision, "DDP")
        first = next(model.parameters(), None)
        if first is not None and precision.masters(first.dtype) is not None:
            return self._with_masters(model, groups)
        return DDPStrategy(model, groups.world, self)

    def _with_masters(self, model: nn.Module, groups: Groups) -> Strategy:
        """Low-precision parameters with fp32 masters: ZeRO-1 on shard groups of one rank."""
        from .zero import ZeRO1, ZeROStrategy  # zero.py builds on this module

        if self.reduce_op != "mean":
            raise ValueError("DDP: reduce_op='sum' is not supported with a low param_dtype")
        mesh = init_mesh(1, groups.world.group)
        solo = Groups.build(None, mesh, groups.world.tracer, groups.world.pairwise)
        policy = ZeRO1(
            bucket_mb=self.bucket_mb,
            first_bucket_mb=self.first_bucket_mb,
            precision=self.precision,
            grad_reduce="all_reduce",
            comm_hook=self.comm_hook,
            hook_state=self.hook_state,
            broadcast_buffers=self.broadcast_buffers,
        )
        return ZeROStrategy(model, solo, policy, name="ddp")

    def footprint(self, shapes, *, model_dtype=torch.float32, **given) -> Footprint:
        """Bytes one rank holds ([Note: footprint] in parts/footprint.py; `given`: `bucketed`'s
        optimizer_bytes, rank); with a low `param_dtype`, ZeRO-1's on shard groups of one rank,
        as `_with_masters` builds it."""
        masters = check_precision(self.precision, "DDP").masters(model_dtype) is not None
        return bucketed(
            shapes, self.precision, stage=1 if masters else 0, shards=1, in_flight=1,
            bucket_bytes=(int(self.bucket_mb * MB), int(self.first_bucket_mb * MB)),
            pairwise=False, model_dtype=model_dtype, **given,
        )  # fmt: skip


def broadcast_model(model: nn.Module, comm: Comm) -> None:
    """Give every rank rank 0's parameters and buffers (one collective per dtype)."""
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    if comm.world_size > 1 and tensors:
        comm.broadcast_tensors(tensors, src=0)


def broadcast_buffers(module: nn.Module, buffers: list[torch.Tensor], comm: Comm) -> None:
    """At a training forward, give every rank rank 0's buffers (BatchNorm statistics).

    Only in train() mode (callers check grad mode), so an evaluation that runs on one rank
    alone never waits for the others.
    """
    if module.training and buffers and comm.world_size > 1:
        comm.broadcast_tensors(buffers, src=0)


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, model: nn.Module, comm: Comm, policy: DDP):
        super().__init__(model, comm)
        self.policy = policy
        verify_same_model(model, comm)
        broadcast_model(model, comm)
        precision = check_precision(policy.precision, "DDP")
        trainable = [p for p in model.parameters() if p.requires_grad]
        planned = list(reversed(trainable))  # [Note: bucket order]
        specs = plan_buckets(
            [(p.numel(), p.dtype, p.device) for p in planned],
            bucket_bytes=int(policy.bucket_mb * MB),
            first_bucket_bytes=int(policy.first_bucket_mb * MB),
        )
        dtype = planned[0].dtype if planned else torch.float32
        if precision.bucket_dtype(dtype) != dtype:
            raise ValueError(
                f"DDP: reduce_dtype={precision.reduce_dtype} is wider than the parameters "
                f"({dtype}); hold them in it and set param_dtype={dtype} for masters, or drop "
                "reduce_dtype"
            )
        hook = policy.comm_hook or default_hook("all_reduce", precision.wire_dtype(dtype))
        self.hook = hook
        self.reducer = GradientReducer(
            planned,
            specs,
            comm,
            hook,
            policy.hook_state or HookState(comm),
            divisor=comm.world_size if policy.reduce_op == "mean" else 1,
        )
        self.casts = install_casts(model, precision, dtype, dtype)
        self.buffers = [b for b in model.buffers()]
        self._pre_hook = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.reducer.prepare()
            if self.policy.broadcast_buffers:
                broadcast_buffers(module, self.buffers, self.comm)

    def _set_sync(self, enabled: bool) -> None:
        self.sync_enabled = enabled
        self.reducer.sync_enabled = enabled

    def build_optimizer(self, optimizer_cls, params=None, **kwargs) -> torch.optim.Optimizer:
        return optimizer_cls(normalize_param_groups(self.model, params), **kwargs)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_optimizer_params(self.model, optimizer.param_groups)
        return optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        # After backward every rank holds the same reduced gradients: the local norm is global.
        grads = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        return {
            "params": tensor_bytes(p.data for p in self.model.parameters()),
            "grads": tensor_bytes(b.buffer for b in self.reducer.buckets),
            "optimizer_state": tensor_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0,
            **hook_state_report(self.reducer.hook),
        }

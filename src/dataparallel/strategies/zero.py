"""ZeRO-1 and ZeRO-2: optimizer state (and, for ZeRO-2, gradients) sharded across ranks.

The contract (docs/zero.md has it in full, with the memory theory and measurements):
- At wrap time the ranks check they hold the same model and take rank 0's weights (as DDP),
  then lay the trainable parameters end to end in flat buckets, planned per optimizer param
  group, padded to a multiple of the world size; the parameters become views into them and
  rank r owns the r-th slice of every bucket ([Note: shard layout] in sharding.py).
- `build_optimizer` builds the user's optimizer over the pieces of this rank's slices ([Note:
  sharded step] in sharded_optimizer.py); when `step()` returns every rank holds the full model.
- Backward reduces bucket by bucket as DDP does ([Note: overlap] in reducer.py) and the
  strategy keeps this rank's slice of the mean gradient: ZeRO-1 keeps full-size buckets,
  ZeRO-2 frees each bucket once reduced ([Note: lazy buckets] in buckets.py), so the model's
  `.grad` is not the global gradient; `clip_grad_norm_` computes the global norm.
- `no_sync` accumulates full local gradients; synchronised backwards between steps add up;
  `optimizer.zero_grad()` clears everything. Each synchronised backward follows a forward.
- Parameters no rank used are skipped by the step, as in one process ([Note: skipped parameters]).
- `param_dtype=torch.bfloat16`: bf16 compute and communication, fp32 master slices and state.
- Checkpoints are whole-model and plain-optimizer shaped, so they move between DDP, ZeRO-1/2
  and world sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm, HookState, allreduce_hook, reduce_scatter_hook
from .base import (
    Strategy,
    normalize_param_groups,
    optimizer_state_tensors,
    tensor_bytes,
    verify_same_model,
)
from .buckets import Bucket, plan_buckets
from .ddp import broadcast_buffers, broadcast_model
from .reducer import GradientReducer
from .sharded_optimizer import (
    Shard,
    ShardedStep,
    flatten_bucket,
    gather_full_params,
    gather_optimizer_state,
    load_masters,
    load_optimizer_state,
    sharded_optimizer_class,
)

MB = 1024 * 1024
MASTER_DTYPE = torch.float32
# Bucket reductions in flight at once in backward: bounds ZeRO-2's full-size buckets and the
# receive buffers of pairwise reduce-scatters (`max_in_flight` in reducer.py).
MAX_IN_FLIGHT = 2


@dataclass(frozen=True, kw_only=True)
class ZeROPolicy:
    """The knobs ZeRO1 and ZeRO2 share.

    bucket_mb: gradient bucket size in MiB (also the unit of sharding and of the parameter
        all-gather). Must be > 0.
    first_bucket_mb: size of the first bucket, kept small so reduction starts early in
        backward. Must be > 0.
    param_dtype: None trains in the model's own dtype, with no extra copy (the optimizer
        updates this rank's slice of the parameters in place); torch.bfloat16 is the ZeRO
        paper's mixed precision: bf16 parameters and gradients for compute and communication,
        fp32 master slices and optimizer state in the shards.
    grad_reduce: "reduce_scatter" sends each rank only its slice of a bucket (half an
        all-reduce's bytes); "all_reduce" reduces the whole bucket everywhere, each rank keeps
        its slice; "auto": reduce_scatter, pairwise on gloo (docs/zero.md), or all_reduce
        under `parallelize(..., pairwise=False)`, gloo's own reduce-scatter being the slower.
    broadcast_buffers: broadcast buffers from rank 0 at each training forward (as DDP).
    overlap_param_gather: True: `step()` only launches the parameter all-gathers, and each
        module's forward waits for the buckets it reads; code that reads or writes parameters
        between `step()` and the next forward calls `dataparallel.finish_param_gather(model)`
        first ([Note: overlapped parameter gather] in param_gather.py). False: whole at once.
    """

    name: ClassVar[str] = "zero"
    stage: ClassVar[int] = 0
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    param_dtype: torch.dtype | None = None
    grad_reduce: str = "auto"
    broadcast_buffers: bool = True
    overlap_param_gather: bool = False

    def __post_init__(self):
        who = type(self).__name__
        if self.stage not in (1, 2):
            raise ValueError(f"{who}: use ZeRO1 or ZeRO2 (this policy names no ZeRO stage)")
        if not self.bucket_mb > 0:
            raise ValueError(f"{who}: bucket_mb={self.bucket_mb} must be > 0 (MiB per bucket)")
        if not self.first_bucket_mb > 0:
            raise ValueError(f"{who}: first_bucket_mb={self.first_bucket_mb} must be > 0")
        if self.param_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"{who}: param_dtype={self.param_dtype} must be None, torch.float32 or "
                "torch.bfloat16 (float16 would need loss scaling, which is not implemented)"
            )
        if self.grad_reduce not in ("auto", "reduce_scatter", "all_reduce"):
            raise ValueError(
                f"{who}: grad_reduce={self.grad_reduce!r} must be 'auto', 'reduce_scatter' "
                "or 'all_reduce'"
            )

    def collective_for(self, comm: Comm, device: torch.device) -> str:
        """The gradient collective `grad_reduce` means on `comm`, for gradients on `device`."""
        return comm.sharded_reduce(device) if self.grad_reduce == "auto" else self.grad_reduce

    def apply(self, model: nn.Module, comm: Comm) -> ZeROStrategy:
        return ZeROStrategy(model, comm, self)


@dataclass(frozen=True, kw_only=True)
class ZeRO1(ZeROPolicy):
    """ZeRO stage 1: optimizer state sharded, full gradients kept. Fields: see ZeROPolicy."""

    name: ClassVar[str] = "zero1"
    stage: ClassVar[int] = 1


@dataclass(frozen=True, kw_only=True)
class ZeRO2(ZeROPolicy):
    """ZeRO stage 2: optimizer state and gradients sharded. Fields: see ZeROPolicy, except
    that `bucket_mb` defaults to 4."""

    name: ClassVar[str] = "zero2"
    stage: ClassVar[int] = 2
    # Smaller than ZeRO-1's: less full-gradient memory in flight, and a freed bucket's memory is
    # reused by the next instead of being faulted back in every step (docs/zero.md, bucket_mb).
    bucket_mb: float = 4.0


class ZeROStrategy(Strategy):
    """ZeRO-1 or ZeRO-2 on one model (the policy's `stage` says which)."""

    def __init__(self, model: nn.Module, comm: Comm, policy: ZeROPolicy):
        super().__init__(model, comm)
        self.name = policy.name
        self.policy = policy
        verify_same_model(model, comm)
        broadcast_model(model, comm)
        self.original_dtypes = {id(p): p.dtype for p in model.parameters()}
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        wants_master = policy.param_dtype not in (None, MASTER_DTYPE)
        self.master_dtype = MASTER_DTYPE if wants_master else None
        device = self.trainable[0].device if self.trainable else comm.device
        collective = policy.collective_for(comm, device)
        self.hook = allreduce_hook if collective == "all_reduce" else reduce_scatter_hook
        self.optimizer: torch.optim.Optimizer | None = None
        self.sharded_step: ShardedStep | None = None
        self.user_groups: list[list[nn.Parameter]] = [list(self.trainable)]
        self.reducer: GradientReducer | None = None
        self.shards: list[Shard] = []
        self.has_grad: list[bool] = []
        self.round_done = False
        self._shard_parameters([list(self.trainable)], values={})
        self.buffers = list(model.buffers())
        self._pre_hook = model.register_forward_pre_hook(self._before_forward)

    # -- laying parameters out in shards ----------------------------------------------------
    def _shard_parameters(self, groups: list[list[nn.Parameter]], values: dict) -> None:
        """(Re)build flat buckets per group; `values` overrides parameters' current values."""
        if self.reducer is not None:
            self.reducer.remove()
        self.groups = [[id(p) for p in g] for g in groups]
        group_of = {id(p): g for g, params in enumerate(groups) for p in params}
        planned = list(reversed(self.trainable))  # [Note: bucket order]
        specs = plan_buckets(
            [
                (p.numel(), self.policy.param_dtype or p.dtype, p.device, group_of.get(id(p), -1))
                for p in planned
            ],
            bucket_bytes=int(self.policy.bucket_mb * MB),
            first_bucket_bytes=int(self.policy.first_bucket_mb * MB),
            pad_to=self.comm.world_size,
        )
        rank, world_size = self.comm.rank, self.comm.world_size
        flats = [
            flatten_bucket(
                s,
                [planned[i] for i in s.param_indices],
                values,
                rank,
                world_size,
                self.master_dtype,
            )
            for s in specs
        ]
        for p in planned:
            p.grad = None
        self.reducer = GradientReducer(
            planned,
            specs,
            self.comm,
            self.hook,
            HookState(self.comm),
            lazy_buffers=self.policy.stage == 2,
            max_in_flight=MAX_IN_FLIGHT,
            on_bucket_reduced=self._on_bucket_reduced,
            on_round_end=self._on_round_end,
        )
        self.reducer.sync_enabled = self.sync_enabled
        self.shards = [
            Shard(bucket, flat, layout, self.comm.rank, master, optimized=spec.group >= 0)
            for bucket, spec, (flat, layout, master) in zip(
                self.reducer.buckets, specs, flats, strict=True
            )
        ]
        self.has_grad = [False] * len(planned)
        self.round_done = False

    # -- the training round ------------------------------------------------------------------
    def _before_forward(self, module, args):
        if torch.is_grad_enabled():
            if self.round_done and self.policy.stage == 1:
                self._clear_consumed_buckets()
            self.reducer.prepare()
            if self.policy.broadcast_buffers:
                broadcast_buffers(module, self.buffers, self.comm)
        if self.master_dtype is not None:
            dtype = self.policy.param_dtype
            return tuple(
                a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
            )
        return None

    def _clear_consumed_buckets(self) -> None:
        """ZeRO-1, first forward after a synchronised backward: restart local accumulation.

        The buckets hold what the last reduction consumed (other ranks' slices, stale); the
        reduced slice is kept apart so a second synchronised backward before the step adds to
        it, as in DDP. A bucket whose grads are all None was zeroed (by the optimizer's or the
        model's zero_grad): its slice is dropped too, and the reducer zeroes the views itself.
        """
        self.round_done = False
        for shard in self.shards:
            if all(p.grad is None for p in shard.bucket.params):
                shard.grad = None
                for i in shard.bucket.spec.param_indices:
                    self.has_grad[i] = False
            if shard.grad is not None:
                shard.grad = shard.grad.clone()
                shard.bucket.buffer.zero_()

    def _on_bucket_reduced(self, bucket: Bucket) -> None:
        shard = self.shards[bucket.index]
        reduced = shard.reduced_slice()
        if self.policy.stage == 1:
            if shard.grad is not None and shard.grad.data_ptr() != reduced.data_ptr():
                reduced.add_(shard.grad)  # kept from an earlier synchronised backward
            shard.grad = reduced
        else:
            if shard.grad is None:
                shard.grad = shard.keep_grad(reduced)
            else:
                shard.grad.add_(reduced)
            bucket.release()  # [Note: lazy buckets]

    def _on_round_end(self, unused: list[int]) -> None:
        unused_set = set(unused)
        for i in range(len(self.has_grad)):
            if i not in unused_set:
                self.has_grad[i] = True
        self.round_done = True

    def zero_shard_grads(self, set_to_none: bool = True) -> None:
        """What the optimizer's zero_grad does to the gradients the strategy keeps."""
        for shard in self.shards:
            bucket = shard.bucket
            if set_to_none:
                shard.grad = None
                if self.policy.stage == 2:
                    bucket.release()
                for p in bucket.params:
                    p.grad = None
            else:
                if shard.grad is not None:
                    shard.grad.zero_()
                if bucket.buffer is not None:
                    bucket.buffer.zero_()
        if set_to_none:
            self.has_grad[:] = [False] * len(self.has_grad)

    def _set_sync(self, enabled: bool) -> None:
        self.sync_enabled = enabled
        self.reducer.sync_enabled = enabled

    # -- the calls the public API forwards ---------------------------------------------------
    def build_optimizer(self, optimizer_cls, params=None, **kwargs) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            raise ValueError(
                f"build_optimizer: strategy {self.name!r} already built this model's sharded "
                "optimizer; build one optimizer per parallelized model"
            )
        groups = normalize_param_groups(self.model, params)
        ids = [id(p) for g in groups for p in g["params"]]
        if len(ids) != len(set(ids)):
            raise ValueError("build_optimizer: a parameter appears in two param groups")
        trainable = {id(p) for p in self.trainable}
        self.user_groups = [list(g["params"]) for g in groups]
        shard_groups = [[p for p in g if id(p) in trainable] for g in self.user_groups]
        if [[id(p) for p in g] for g in shard_groups] != self.groups:
            values = gather_full_params(self.shards, self.comm, self.master_dtype)
            self._shard_parameters(shard_groups, values)
        optimizer = sharded_optimizer_class(optimizer_cls)(
            [
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [
                        t for s in self.shards if s.bucket.spec.group == g for t in s.tensors
                    ],
                }
                for g, group in enumerate(groups)
            ],
            **kwargs,
        )
        optimizer.zero_shard_grads = self.zero_shard_grads
        overlap_with = self.model if self.policy.overlap_param_gather else None
        self.sharded_step = ShardedStep(self.shards, self.comm, self.has_grad, overlap_with)
        optimizer.register_step_pre_hook(self.sharded_step.before)
        optimizer.register_step_post_hook(self.sharded_step.after)
        self.optimizer = optimizer
        return optimizer

    def finish_param_gather(self) -> None:
        if self.sharded_step is not None:
            self.sharded_step.gather.finish()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm: each rank's slices' norms combined with one all-reduce, then scaled."""
        norm_type = float(norm_type)
        grads = [s.grad for s in self.shards if s.grad is not None]
        total = torch.zeros((), dtype=torch.float32, device=self.comm.device)
        for g in grads:
            norm = torch.linalg.vector_norm(g.float(), norm_type).to(total.device)
            total = torch.maximum(total, norm) if math.isinf(norm_type) else total + norm**norm_type
        if self.comm.world_size > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            self.comm.all_reduce(total, op=op)
        if not math.isinf(norm_type):
            total = total ** (1.0 / norm_type)
        # torch.nn.utils.clip_grad_norm_'s formula, so clipped runs match single-process ones
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.finish_param_gather()
        values = gather_full_params(self.shards, self.comm, self.master_dtype)
        out = {}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            value = values.get(id(tensor), tensor.detach())
            dtype = self.original_dtypes.get(id(tensor), value.dtype)
            out[key] = value.to("cpu", dtype, copy=True)
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.finish_param_gather()
        self.model.load_state_dict(state_dict)  # into the flat buffers the params view
        if self.master_dtype is not None:
            names = {id(p): name for name, p in self.model.named_parameters()}
            load_masters(self.shards, {i: state_dict[name] for i, name in names.items()})

    def _optimizer_shards(self, optimizer: torch.optim.Optimizer) -> list[Shard]:
        """The shards `optimizer` steps, in bucket order (the same on every rank)."""
        if optimizer is not self.optimizer:
            raise ValueError(
                f"{self.name}: this optimizer was not built by dataparallel.build_optimizer "
                "for this model"
            )
        return [s for s in self.shards if s.optimized]

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        shards = self._optimizer_shards(optimizer)
        return gather_optimizer_state(optimizer, shards, self.comm, self.user_groups)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        shards = self._optimizer_shards(optimizer)
        load_optimizer_state(optimizer, shards, self.user_groups, state)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds; in mixed precision the fp32 masters count as optimizer state
        (the ZeRO paper's K = 12 bytes per parameter) and are also reported on their own."""
        masters = [s.param for s in self.shards if s.param is not s.own]
        grads = [b.buffer for b in self.reducer.buckets]
        grads += [s.grad for s in self.shards] + [s.grad_store for s in self.shards]
        state = optimizer_state_tensors(optimizer) if optimizer is not None else []
        return {
            "params": tensor_bytes(p.data for p in self.model.parameters()),
            "grads": tensor_bytes(grads),
            "optimizer_state": tensor_bytes(state + masters),
            "master_params": tensor_bytes(masters),
        }

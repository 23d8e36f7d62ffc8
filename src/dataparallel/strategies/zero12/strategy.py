"""ZeRO-1 and ZeRO-2: optimizer state (and, for ZeRO-2, gradients) sharded across ranks.

The contract (docs/zero.md has it in full, with the memory theory and measurements):
- At wrap time the ranks check they hold the same model and take rank 0's weights (as DDP),
  then lay the trainable parameters end to end in flat buckets, planned per optimizer param
  group, padded to a multiple of the shard group's size; the parameters become views into them
  and rank r of the shard group owns the r-th slice of every bucket ([Note: sharded step] in
  step.py; [Note: mesh] in parts/mesh.py for 2-D layouts).
- `build_optimizer` builds the user's optimizer over the pieces of this rank's slices (an
  optimizer that is not elementwise: over the whole parameters this rank owns, [Note:
  optimizer layout] in parts/owners.py); when `step()` returns every rank holds the full model.
- Backward reduces bucket by bucket as DDP does ([Note: overlap] in parts/reducer.py), through
  the policy's communication hook ([Note: reduction interface] in comm/hooks.py); what happens
  to a reduced bucket is the only difference between the stages: ZeRO-1 keeps full-size
  buckets, ZeRO-2 frees each once its shard is kept ([Note: lazy buckets]). At the end of
  backward the reduced shard gradients are the pieces' `.grad` ([Note: flat shard]); the
  model's own `.grad` refuse every use ([Note: consumed sums], [Note: sharded gradients] in
  parts/sharded_grads.py): clear with `optimizer.zero_grad()`.
- `no_sync` accumulates full local gradients; synchronised backwards between steps add up, as
  in one process, until `optimizer.zero_grad()`. Each synchronised backward follows a forward.
- Parameters no rank used are skipped by the step ([Note: skipped parameters]).
- `precision=MixedPrecision(...)`: [Note: mixed precision] in parts/precision.py.
- Checkpoints are whole-model and plain-optimizer shaped, so they move between DDP, ZeRO-1/2/3
  and world sizes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...comm import HookState
from ...comm.hooks import default_hook
from ..base import (
    Strategy,
    broadcast_buffers,
    broadcast_model,
    normalize_param_groups,
    verify_same_model,
)
from ..parts.buckets import MB, Bucket, plan_buckets
from ..parts.clip import clip_shards_
from ..parts.geometry import Geometry, build_geometry, optimized_ids
from ..parts.mesh import Groups
from ..parts.opaque import opaque
from ..parts.owners import Owners, own_groups
from ..parts.precision import install_casts, norm_params
from ..parts.reducer import GradientReducer
from ..parts.sharded_grads import ShardedGrads
from ..parts.tensor_parallel import to_local
from .step import BucketShard, ShardedStep, flatten_bucket

# Bucket reductions in flight at once in backward: bounds ZeRO-2's full-size buckets and the
# receive buffers of pairwise reduce-scatters (`max_in_flight` in reducer.py).
MAX_IN_FLIGHT = 2


class ZeROStrategy(Strategy):
    """ZeRO-1 or ZeRO-2 on one model: buckets, their shards, and the policy's keeper."""

    def __init__(self, model: nn.Module, groups: Groups, policy, name=None):  # a ZeRO1/ZeRO2
        super().__init__(model, groups.world, groups)
        self.name = name or policy.name
        self.policy = policy
        self.precision = policy.precision  # a MixedPrecision ([Note: full precision])
        self.keeper = policy.keeper()
        verify_same_model(model, groups.world)
        broadcast_model(model, groups.world)
        self.original_dtypes = {id(p): p.dtype for p in model.parameters()}
        first = next(model.parameters(), None)
        self.model_dtype = first.dtype if first is not None else torch.float32
        self.compute = self.precision.compute_dtype(self.model_dtype)
        self.norms = norm_params(model)  # held in fp32 ([Note: mixed precision])
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None
        self.sharded_step: ShardedStep | None = None
        self.owners: Owners | None = None  # [Note: optimizer layout] in parts/owners.py
        self.user_groups_: list[list[nn.Parameter]] = [list(self.trainable)]
        self.reducer: GradientReducer | None = None
        self.buckets: list[BucketShard] = []
        self.round_done = False  # a synchronised backward ended, no forward since
        self._shard_parameters([list(self.trainable)], values={})
        # In the round's order ([Note: bucket order]); [Note: sharded gradients]
        self.sharded_grads = ShardedGrads(list(reversed(self.trainable)), self.name)
        self.buffers = list(model.buffers())
        self.casts = install_casts(model, self.precision, self.compute, self.model_dtype)
        self._pre_hook = model.register_forward_pre_hook(opaque(self._before_forward))

    def _dtype_of(self, p: nn.Parameter) -> torch.dtype:
        original = self.original_dtypes[id(p)]
        return original if id(p) in self.norms else self.precision.compute_dtype(original)

    # -- laying parameters out in shards ----------------------------------------------------
    def _shard_parameters(self, groups: list[list[nn.Parameter]], values: dict) -> None:
        """(Re)build flat buckets per group; `values` overrides parameters' current values."""
        if self.reducer is not None:
            self.reducer.remove()
        self.groups_ids = [[id(p) for p in g] for g in groups]
        group_of = {id(p): g for g, params in enumerate(groups) for p in params}
        planned = list(reversed(self.trainable))  # [Note: bucket order]
        self.planned = planned
        shard_comm = self.groups.shard
        specs = plan_buckets(
            [(p.numel(), self._dtype_of(p), p.device, group_of.get(id(p), -1)) for p in planned],
            bucket_bytes=int(self.policy.bucket_mb * MB),
            first_bucket_bytes=int(self.policy.first_bucket_mb * MB),
            pad_to=shard_comm.world_size,
        )
        self.buckets = []
        for spec in specs:
            params = [planned[i] for i in spec.param_indices]
            masters = self.precision.masters(self.original_dtypes[id(params[0])])
            masters = None if spec.dtype == masters else masters
            self.buckets.append(
                flatten_bucket(
                    spec, params, values, shard_comm.rank, shard_comm.world_size, masters,
                    optimized=spec.group >= 0,
                )
            )  # fmt: skip
        for p in planned:
            p.grad = None
        device = planned[0].device if planned else self.comm.device
        wire = self.precision.wire_dtype(self.compute)
        hook = self.policy.comm_hook or default_hook(
            self.policy.collective_for(shard_comm, device), wire
        )
        grad_specs = [replace(s, dtype=self.precision.bucket_dtype(s.dtype)) for s in specs]
        if shard_comm.world_size == 1 and self.groups.replicate is not None:
            # Shard groups of one rank (DDP with masters): the hook sees DDP's whole buckets.
            state = HookState(self.groups.replicate)
            shards = None
        else:
            state = HookState(shard_comm, self.groups.replicate)
            shards = [b.shard.layout.shard_range(b.shard.rank) for b in self.buckets]
        state = self.policy.hook_state or state
        self.hook = hook
        self.reducer = GradientReducer(
            planned,
            grad_specs,
            self.groups.world,
            hook,
            state,
            divisor=self.groups.divisor,
            shards=shards,
            lazy_buffers=self.keeper.lazy,
            max_in_flight=MAX_IN_FLIGHT,
            on_bucket_reduced=self._on_bucket_reduced,
            on_round_end=self._on_round_end,
            flat_shards=[b.shard for b in self.buckets],
        )
        self.reducer.sync_enabled = self.sync_enabled

    # -- the training round ------------------------------------------------------------------
    def _before_forward(self, module, args):
        if torch.is_grad_enabled():
            self.sharded_grads.drop()
            if self.round_done:
                self.round_done = False
                for bucket, grads in zip(self.buckets, self.reducer.buckets, strict=True):
                    self.keeper.before_round(bucket.shard, grads)
            self.reducer.prepare()
            if self.policy.broadcast_buffers:
                broadcast_buffers(module, self.buffers, self.comm)

    def _on_bucket_reduced(self, bucket: Bucket) -> None:
        self.keeper.reduced(self.buckets[bucket.index].shard, bucket)

    def _on_round_end(self, used: list[bool]) -> None:
        for bucket, grads in zip(self.buckets, self.reducer.buckets, strict=True):
            bucket.shard.attach_grads([used[i] for i in grads.spec.param_indices])
            self.keeper.after_round(bucket.shard, grads)
        if self.owners is not None:
            self.owners.collect_grads({id(p) for p, u in zip(self.planned, used, strict=True) if u})
        self.sharded_grads.attach(used)
        self.round_done = True

    def rebind(self, group) -> None:
        """Train over another elastic mesh of this model's shard size (`Groups.rebind`); a
        round that failed half-way is dropped (the caller drops the gradients too)."""
        self.groups.rebind(group, self.name)
        self.reducer.rebind(divisor=self.groups.divisor)

    def _set_sync(self, enabled: bool) -> None:
        self.sync_enabled = enabled
        self.reducer.sync_enabled = enabled

    # -- the calls the public API forwards ---------------------------------------------------
    def build_optimizer(
        self, optimizer_cls, params=None, *, whole: bool | list[bool] = False, **kwargs
    ) -> torch.optim.Optimizer:
        """The user's optimizer over this rank's flat shard pieces, or, for the groups
        `whole` names (True: all), over the whole masters it owns ([Note: optimizer layout]
        in parts/owners.py)."""
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
        self.user_groups_ = [list(g["params"]) for g in groups]
        shard_groups = [[p for p in g if id(p) in trainable] for g in self.user_groups_]
        if [[id(p) for p in g] for g in shard_groups] != self.groups_ids:
            self._shard_parameters(shard_groups, self._full_values())
        wholes = whole if isinstance(whole, list) else [whole] * len(groups)
        chosen = [
            [
                t
                for b, grads in zip(self.buckets, self.reducer.buckets, strict=True)
                if grads.spec.group == g
                for t in b.shard.params
            ]
            for g in range(len(groups))
        ]
        if any(wholes):
            shards = [(b.shard, b.params) for b in self.buckets]
            owned = [g if w else [] for g, w in zip(shard_groups, wholes, strict=True)]
            name = optimizer_cls.__name__
            self.owners, masters = own_groups(owned, shards, self.groups.shard, name)
            chosen = [m if w else c for m, c, w in zip(masters, chosen, wholes, strict=True)]
        optimizer = optimizer_cls(
            [
                {**{k: v for k, v in group.items() if k != "params"}, "params": params_of}
                for group, params_of in zip(groups, chosen, strict=True)
            ],
            **kwargs,
        )
        overlap_with = self.model if self.policy.overlap_param_gather else None
        self.sharded_step = ShardedStep(self.buckets, self.groups.shard, overlap_with)
        optimizer.register_step_pre_hook(self.sharded_step.before)
        if self.owners is not None:  # the owners' new values into the shards, then gathered
            optimizer.register_step_post_hook(lambda *_: self.owners.send_values())
        optimizer.register_step_post_hook(self.sharded_step.after)
        self.optimizer = optimizer
        return optimizer

    def finish_param_gather(self) -> None:
        if self.sharded_step is not None:
            self.sharded_step.gather.finish()

    def refresh_params(self) -> None:
        """Masters (or shards) changed outside step(): write them back and all-gather every
        bucket again."""
        self.finish_param_gather()
        shard = self.groups.shard
        if self.owners is not None:
            self.owners.send_values()
        for bucket in self.buckets:
            bucket.write_back()
            if shard.world_size > 1:
                shard.all_gather(bucket.flat, bucket.own)

    def _full_values(self) -> dict[int, torch.Tensor]:
        """id(trainable parameter) -> its whole value (the masters' under mixed precision).
        Collective over the shard group."""
        full = self.full_state_dict()
        names = self.geometry().names
        # A tensor-parallel parameter holds its local part of the whole tensor.
        return {id(p): to_local(p, full[names[id(p)]]).to(p.device) for p in self.trainable}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        shards = [(b.shard, b.params) for b in self.buckets]
        params = list(self.model.parameters())
        owned = self.owners.grads() if self.owners is not None else []
        return clip_shards_(shards, params, max_norm, norm_type, self.groups.shard, owned)

    def shard_holders(self) -> list[BucketShard]:
        return self.buckets

    def owned_runs(self) -> list:
        return self.owners.runs() if self.owners is not None else []

    def geometry(self, optimizer: torch.optim.Optimizer | None = None) -> Geometry:
        """The buckets' shard pieces (masters in mixed precision), frozen parameters whole
        ([Note: geometry])."""
        if optimizer is not None:
            self._check_ours(optimizer)
        shards = [(b.shard, b.params) for b in self.buckets]
        optimized = optimized_ids(optimizer)
        owned = self.owners.masters() if self.owners is not None else None
        return build_geometry(
            self.model, shards, self.groups.shard, optimized, self.original_dtypes, owned
        )

    def user_groups(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        self._check_ours(optimizer)
        return self.user_groups_

    def _check_ours(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.optimizer:
            raise ValueError(
                f"{self.name}: this optimizer was not built by dataparallel.build_optimizer "
                "for this model"
            )

    def working_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grads = [b.buffer for b in self.reducer.buckets] + [b.shard.store for b in self.buckets]
        return [p.data for p in self.model.parameters()], grads

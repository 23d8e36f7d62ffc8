"""ZeRO-1 and ZeRO-2: optimizer state (and, for ZeRO-2, gradients) sharded across ranks.

The contract (docs/zero.md has it in full, with the memory theory and measurements):
- At wrap time the ranks check they hold the same model and take rank 0's weights (as DDP),
  then lay the trainable parameters end to end in flat buckets, planned per optimizer param
  group, padded to a multiple of the shard group's size; the parameters become views into them
  and rank r of the shard group owns the r-th slice of every bucket ([Note: sharded step] in
  step.py; [Note: mesh] in parts/mesh.py for 2-D layouts).
- `build_optimizer` builds the user's optimizer over the pieces of this rank's slices (an
  optimizer that is not elementwise: over the whole parameters this rank owns, [Note:
  optimizer layout] in parts/optimizer_layout.py); when `step()` returns every rank holds the
  full model. Several optimizers per model ([Note: built optimizers] in parts/built.py).
- Backward reduces bucket by bucket as DDP does ([Note: overlap] in parts/reducer.py), through
  the policy's communication hook ([Note: reduction interface] in comm/hooks.py); what happens
  to a reduced bucket is the only difference between the stages: ZeRO-1 keeps full-size
  buckets, ZeRO-2 frees each once its shard is kept ([Note: lazy buckets]). At the end of
  backward the reduced shard gradients are the pieces' `.grad` ([Note: flat shard]); the
  model's own `.grad` read them where they live ([Note: consumed sums], [Note: sharded
  gradients] in parts/sharded_grads.py), so PyTorch's clips and `model.zero_grad()` work.
- `no_sync` accumulates full local gradients; synchronised backwards between steps add up, as
  in one process, until `optimizer.zero_grad()`. Each synchronised backward follows a forward.
- Parameters no rank used are skipped by the step ([Note: skipped parameters]).
- `precision=MixedPrecision(...)`: [Note: mixed precision] in parts/precision.py.
- Checkpoints are whole-model and plain-optimizer shaped, so they move between DDP, ZeRO-1/2/3
  and world sizes.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import nn

from ...comm import HookState
from ...comm.hooks import default_hook
from ..base import (
    broadcast_buffers,
    broadcast_model,
    normalize_param_groups,
    verify_same_model,
)
from ..parts.buckets import MB, plan_buckets
from ..parts.built import Built, BuiltOptimizers, check_new_groups
from ..parts.geometry import Geometry, build_geometry, optimized_ids
from ..parts.held_grads import HeldGrads, ShardedGrads
from ..parts.mesh import Groups
from ..parts.opaque import opaque
from ..parts.owners import own_groups
from ..parts.precision import install_casts, norm_params
from ..parts.reducer import GradientReducer
from ..parts.tensor_parallel import to_local
from ..parts.torch_calls import ModelCalls, OptimizerCalls, is_carrier
from ..sharded import ShardedStrategy
from .step import BucketShard, ShardedStep, flatten_bucket

# Bucket reductions in flight at once in backward: bounds ZeRO-2's full-size buckets and the
# receive buffers of pairwise reduce-scatters (`max_in_flight` in reducer.py).
MAX_IN_FLIGHT = 2


def layout_name(policy, groups: Groups) -> str:
    """The strategy's name read from its layout: ZeRO-1 on shard groups of one rank across
    several replicas holds every state whole on every rank and all-reduces the gradients, which
    is DDP with fp32 masters ([Note: resolution] in strategies/resolve.py), so it is "ddp"."""
    replicas = groups.replicate is not None and groups.replicate.world_size > 1
    one_rank_shards = groups.shard.world_size == 1 and replicas
    return "ddp" if one_rank_shards and policy.name == "zero1" else policy.name


class ZeROStrategy(ShardedStrategy):
    """ZeRO-1 or ZeRO-2 on one model: buckets, their shards, and the policy's keeper."""

    def __init__(self, model: nn.Module, groups: Groups, policy):  # a ZeRO1/ZeRO2
        super().__init__(model, groups.world, groups)
        self.name = layout_name(policy, groups)
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
        self.built = BuiltOptimizers(self.name)  # [Note: built optimizers] in parts/built.py
        self.buckets: list[BucketShard] = []
        self.round_done = False  # a synchronised backward ended, no forward since
        self.held = None  # where the reduced gradients live ([Note: sharded gradients])
        self._shard_parameters([list(self.trainable)], values={})
        # In the round's order ([Note: bucket order]); [Note: sharded gradients]
        self.sharded_grads = ShardedGrads(list(reversed(self.trainable)), self.name)
        self.sharded_grads.source = self.held
        ModelCalls(model, self)  # [Note: torch's own calls] in parts/torch_calls.py
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
        group_of = {id(p): g for g, params in enumerate(groups) for p in params}  # else None
        planned = list(reversed(self.trainable))  # [Note: bucket order]
        self.planned = planned
        shard_comm = self.groups.shard
        specs = plan_buckets(
            [(p.numel(), self._dtype_of(p), p.device, group_of.get(id(p))) for p in planned],
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
                    spec,
                    params,
                    values,
                    shard_comm.rank,
                    shard_comm.world_size,
                    masters,
                    optimized=spec.group is not None,
                )
            )
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
            keeper=self.keeper,
            max_in_flight=MAX_IN_FLIGHT,
            on_round_end=self._on_round_end,
            flat_shards=[b.shard for b in self.buckets],
        )
        for bucket, grads in zip(self.buckets, self.reducer.buckets, strict=True):
            bucket.grads = grads  # one object: the parameters' buffer, its shard, its gradients
        self.reducer.sync_enabled = self.sync_enabled
        if self.held is None:
            self.held = HeldGrads(self.buckets, self.built.owned_of, shard_comm)
        self.held.lay(self.buckets)

    # -- the training round ------------------------------------------------------------------
    def _before_forward(self, module, args):
        if torch.is_grad_enabled():
            self.sharded_grads.drop()
            if self.round_done:
                self.round_done = False
                for bucket in self.buckets:
                    self.keeper.before_round(bucket.grads)
            self.reducer.prepare()
            if self.policy.broadcast_buffers:
                broadcast_buffers(module, self.buffers, self.comm)

    def _on_round_end(self, used: list[bool]) -> None:
        for bucket in self.buckets:
            bucket.shard.attach_grads([used[i] for i in bucket.grads.spec.param_indices])
        if self.built.owners():  # [Note: whole parameters]: the reduced pieces to the owners
            self.built.collect_grads({id(p) for p, u in zip(self.planned, used, strict=True) if u})
        self.built.verdict(self.reducer.round.nonfinite)  # [Note: torch's own calls]
        self.sharded_grads.attach(used)
        self.round_done = True

    def rebind(self, group) -> None:
        """Train over another elastic mesh of this model's shard size (`Groups.rebind`); a
        round that failed half-way is dropped (the caller drops the gradients too)."""
        self.groups.rebind(group, self.name)
        self.reducer.rebind(divisor=self.groups.divisor)

    # -- the calls the public API forwards ---------------------------------------------------
    def build_optimizer(
        self, optimizer_cls, params=None, *, reads: str | list[str] = "element", **kwargs
    ) -> torch.optim.Optimizer:
        """The user's optimizer over this rank's flat shard pieces, or, for the groups whose
        update reads more than an element, over the whole masters it owns ([Note: optimizer
        layout] in parts/optimizer_layout.py). Several optimizers may be built for one model
        ([Note: built optimizers] in parts/built.py), all of them before the first step."""
        groups = normalize_param_groups(self.model, params)
        check_new_groups(groups, self.built)
        user_groups = [list(g["params"]) for g in groups]
        shard_groups = self._shard_groups([*(b.user_groups for b in self.built.all), user_groups])
        if [[id(p) for p in g] for g in shard_groups] != self.groups_ids:
            self._lay_again(shard_groups)
        built = Built(
            None, user_groups, reads if isinstance(reads, list) else [reads] * len(groups)
        )
        chosen = self._tensors_for(built, len(shard_groups) - len(groups), optimizer_cls.__name__)
        built.optimizer = optimizer_cls(
            [
                {**{k: v for k, v in group.items() if k != "params"}, "params": tensors}
                for group, tensors in zip(groups, chosen, strict=True)
            ],
            **kwargs,
        )
        self._attach(built, len(shard_groups) - len(groups))
        self.built.add(built)
        return built.optimizer

    def _shard_groups(self, optimizers: list[list[list[nn.Parameter]]]) -> list[list]:
        """The trainable parameters of every optimizer's groups, one list per group."""
        trainable = {id(p) for p in self.trainable}
        return [[p for p in g if id(p) in trainable] for groups in optimizers for g in groups]

    def _lay_again(self, shard_groups: list[list[nn.Parameter]]) -> None:
        """Re-plan the buckets for these groups (collective), and put the optimizers built
        before onto the new pieces: possible only while none of them has state."""
        if any(len(b.optimizer.state) for b in self.built.all):
            raise ValueError(
                f"build_optimizer: under {self.name} every optimizer of a model is built before "
                "the first step (a new one lays the shards out again under the others); build "
                "them all, then train"
            )
        self.finish_param_gather()
        self._shard_parameters(shard_groups, self._full_values())
        first = 0
        for built in self.built.all:
            built.step.detach()
            chosen = self._tensors_for(built, first, type(built.optimizer).__name__)
            for group, tensors in zip(built.optimizer.param_groups, chosen, strict=True):
                group["params"] = tensors + [t for t in group["params"] if is_carrier(t)]
            built.step = self._sharded_step(first, len(built.user_groups))
            first += len(built.user_groups)
        self.built.relay_owners()

    def _tensors_for(self, built: Built, first: int, who: str) -> list[list[torch.Tensor]]:
        """Per group of `built` (the groups from `first` on in the bucket plan), what its
        optimizer steps: the pieces of the group's buckets, or the masters this rank owns."""
        count = len(built.user_groups)
        chosen = [
            [t for b in self.buckets if b.grads.spec.group == first + g for t in b.shard.params]
            for g in range(count)
        ]
        built.owners = None
        if any(read != "element" for read in built.reads):
            shards = [(b.shard, b.params) for b in self.buckets]
            groups = self.groups_of(first, count)
            owned = [g if r != "element" else [] for g, r in zip(groups, built.reads, strict=True)]
            built.owners, masters = own_groups(owned, shards, self.groups.shard, who, built.reads)
            chosen = [
                m if r != "element" else c
                for m, c, r in zip(masters, chosen, built.reads, strict=True)
            ]
        return chosen

    def groups_of(self, first: int, count: int) -> list[list[nn.Parameter]]:
        """The trainable parameters of the bucket plan's groups `first` to `first + count`."""
        by_id = {id(p): p for p in self.trainable}
        return [[by_id[i] for i in ids] for ids in self.groups_ids[first : first + count]]

    def _sharded_step(self, first: int, count: int) -> ShardedStep:
        mine = [
            b for b in self.buckets if b.optimized and first <= b.grads.spec.group < first + count
        ]
        overlap_with = self.model if self.policy.overlap_param_gather else None
        return ShardedStep(mine, self.groups.shard, overlap_with)

    def _attach(self, built: Built, first: int) -> None:
        """The step hooks of one optimizer ([Note: sharded step] in step.py) and its torch
        calls ([Note: torch's own calls])."""
        optimizer = built.optimizer
        built.step = self._sharded_step(first, len(built.user_groups))
        to_local = partial(self._to_local, optimizer)
        device = self.comm.device
        built.calls = OptimizerCalls(optimizer, self.name, to_local, self.refresh_params, device)
        optimizer.register_step_pre_hook(partial(self._before_step, built))
        optimizer.register_step_post_hook(partial(self._after_step, built))

    def _before_step(self, built: Built, optimizer, args, kwargs) -> None:
        self.sharded_grads.reconcile()  # [Note: sharded gradients]: a .grad set to None
        built.step.before(optimizer, args, kwargs)

    def _after_step(self, built: Built, optimizer, args, kwargs) -> None:
        built.after_step(self.groups.shard)  # the owners' values into the shards
        built.step.after(optimizer, args, kwargs)

    def finish_param_gather(self) -> None:
        for built in self.built.all:
            built.step.gather.finish()

    def refresh_params(self) -> None:
        """Masters (or shards) changed outside step(): write them back and all-gather every
        bucket again."""
        self.finish_param_gather()
        shard = self.groups.shard
        for owners in self.built.owners():
            owners.send_values()
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

    def shard_holders(self) -> list[BucketShard]:
        return self.buckets

    def geometry(self, optimizer: torch.optim.Optimizer | None = None) -> Geometry:
        """The buckets' shard pieces (masters in mixed precision), frozen parameters whole
        ([Note: geometry])."""
        if optimizer is not None:
            self.built.of(optimizer)
        shards = [(b.shard, b.params) for b in self.buckets]
        optimized = optimized_ids(optimizer)
        owned = self.built.masters() or None
        return build_geometry(
            self.model, shards, self.groups.shard, optimized, self.original_dtypes, owned
        )

    def working_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grads = [b.grads.buffer for b in self.buckets] + [b.shard.store for b in self.buckets]
        return [p.data for p in self.model.parameters()], grads

"""ZeRO-3 (FSDP): parameters, gradients and optimizer state all sharded across the ranks.

The contract (what `parallelize(model, ZeRO3(...))` guarantees):
- At wrap time every rank checks it holds the same model and takes rank 0's weights; each
  wrapped unit's parameters become one flat shard per rank ([Note: flat layout] in
  unit.py), padded so any size works. Between steps a rank holds only its shards.
- A unit's parameters are all-gathered just before its forward and freed after it, gathered
  again before its backward, and its gradients are averaged across ranks right after its
  backward, one collective per unit ([Note: schedule] in schedule.py). A unit may be
  several consecutive modules, each run once per forward, in order ([Note: grouped units] in
  plan.py).
- After `loss.backward()` returns, the optimizer's parameters (shard pieces) hold the average
  gradient; an elementwise optimizer (SGD, Adam, AdamW, ...) then steps exactly as it would on
  the whole model in one process.
- Every rank must run the same units in the same order each step (the collectives of one
  process group are matched by order); a rank that does not stops every rank with one error
  ([Note: same units on every rank]). Inside a unit, parameters may go unused on any rank.
- Read and write weights with `dp.full_state_dict` / `dp.load_full_state_dict`; outside its
  unit's forward a parameter reads as NaN ([Note: parameters at rest] in unit.py).

The strategy is wiring: module hooks and gradient hooks that call each unit's verbs ([Note:
unit life cycle] in unit.py) and the step's `Schedule` ([Note: schedule] in
schedule.py: prefetch, resharding, the one reduction in flight, the unit-order check).
When autograd has finished, a queued callback reduces what is left, waits for everything,
agrees with every rank on which parameters none used and on found-inf ([Note: backward round]),
and ends every unit's round.

[Note: compile] `torch.compile` works on the model before or after `parallelize`, whole or per
block. Every hook of ours is opaque to the compiler (`torch.compiler.disable`): the compiler
stops at a unit's hooks, runs them eagerly, and compiles the code between them, which runs
only while the unit is gathered, so what it traces and guards on are the gathered views, the
same every step ([Note: parameters at rest] in unit.py). A whole-model compile therefore
makes one graph per stretch between unit boundaries (per block: a block's forward stays one
graph); collectives never enter a graph.

Mixed precision ([Note: mixed precision] in parts/precision.py): with
`MixedPrecision(param_dtype=torch.bfloat16)` the gathered parameters, the gradients and their
reduction are bf16 (the reduction in `reduce_dtype` when one is set): each shard is cast just
before its all-gather, and gradients are divided before the sum. Masters, gradient shards
and optimizer state stay fp32: 4 + 4 + 8 = 16 bytes per parameter / S (the ZeRO paper's 2 + 2
+ 12 keeps bf16 parameter and gradient shards; ours exist only while gathered). Norms are units
of their own, in fp32. Under a 2-D mesh ([Note: mesh] in parts/mesh.py) units shard over the S
ranks of a shard group and each reduced shard is all-reduced across the replicas.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from ...comm import HookState
from ...comm.hooks import default_hook
from ...torch_internals import tree_flatten, tree_unflatten
from ..base import (
    broadcast_model,
    broadcast_values,
    normalize_param_groups,
    verify_same_model,
)
from ..parts.built import Built, BuiltOptimizers, check_new_groups
from ..parts.geometry import Geometry, build_geometry, optimized_ids
from ..parts.held_grads import HeldGrads
from ..parts.mesh import Groups
from ..parts.opaque import opaque
from ..parts.owners import own_groups
from ..parts.precision import cast_floats, install_casts, is_norm
from ..parts.round import BackwardRound
from ..parts.torch_calls import ModelCalls, OptimizerCalls
from ..sharded import ShardedStrategy
from .group import GroupedUnits, MemberRun
from .plan import plan_units, with_norms
from .schedule import Schedule
from .unit import FlatUnit, PostBackward


class ZeRO3Strategy(ShardedStrategy):
    """Wiring: module and gradient hooks that call the units' verbs and the schedule."""

    name = "zero3"
    placeholders_at_rest = True  # [Note: parameters at rest] in unit.py

    def __init__(self, model: nn.Module, groups: Groups, policy):  # a ZeRO3 (policy.py)
        super().__init__(model, groups.world, groups)
        self.policy = policy
        self.precision = precision = policy.precision  # [Note: full precision]
        verify_same_model(model, groups.world)
        lazy = policy.materialize is not None
        if lazy:  # the parameters are broadcast unit by unit below
            broadcast_values(list(model.buffers()), groups.world)
        else:
            broadcast_model(model, groups.world)
        first = next(model.parameters(), None)
        model_dtype = first.dtype if first is not None else torch.float32
        self.compute = precision.compute_dtype(model_dtype)
        device = first.device if first is not None and not lazy else self.comm.device
        reduce = policy.reduce
        if reduce == "auto":
            reduce = groups.shard.sharded_reduce(device)
        self.reduce = reduce
        self.hook = policy.comm_hook or default_hook(reduce, precision.wire_dtype(self.compute))
        self.hook_state = policy.hook_state or HookState(groups.shard, groups.replicate)
        norms_apart = precision.masters(model_dtype) is not None  # held in fp32
        wrap = with_norms(model, policy.wrap) if norms_apart else policy.wrap
        plans = plan_units(model, wrap, policy.min_unit_params)
        self.units = [self._unit(i, plan, model_dtype, lazy) for i, plan in enumerate(plans)]
        self.round = BackwardRound(sum(len(u.params) for u in self.units), groups.world)
        self.first_index = [0]
        for u in self.units:
            self.first_index.append(self.first_index[-1] + len(u.params))
        self.schedule = Schedule(
            self.units,
            policy.prefetch,
            policy.reshard_after_forward,
            groups.shard,
            policy.check_order,
        )
        self.casts = install_casts(model, precision, self.compute, model_dtype)
        self.piece_of = {
            id(p): piece
            for u in self.units
            for p, piece in zip(u.params, u.shard.pieces, strict=True)
        }
        self.built = BuiltOptimizers(self.name)  # [Note: built optimizers] in parts/built.py
        # where the reduced gradients live ([Note: sharded gradients])
        self.held = HeldGrads(self.units, self.built.owned_of, groups.shard)
        for unit in self.units:
            unit.sharded_grads.source = self.held
        self.handles = []
        self._hook_modules(plans)
        self._hook_params()
        ModelCalls(model, self)  # [Note: torch's own calls] in parts/torch_calls.py

    def _unit(self, i: int, plan, model_dtype: torch.dtype, lazy: bool) -> FlatUnit:
        """Unit `i` of the plan, its parameters first materialized and broadcast when `lazy`."""
        precision, groups = self.precision, self.groups
        norm = is_norm(plan.module) and precision.masters(model_dtype) is not None
        compute = model_dtype if norm else self.compute  # norms stay fp32
        bucket = precision.bucket_dtype(compute)
        if lazy:  # [Note: parameters on the meta device] in models/hf.py
            self.policy.materialize(plan.params)
            broadcast_values([p.data for p in plan.params], groups.world)
        return FlatUnit(i, plan, groups.shard, compute, bucket, groups.divisor)

    def _hook_modules(self, plans) -> None:
        """Each unit's module gets the forward hooks that gather and free it; a unit whose
        members are several modules, one pair per member ([Note: members in order])."""
        self.grouped = GroupedUnits([plan.parent for plan in plans])
        of_module: dict[int, list[FlatUnit]] = {}  # a module's units ([Note: frozen parameters])
        for unit, plan in zip(self.units, plans, strict=True):
            of_module.setdefault(id(plan.module), []).append(unit)
        for units in of_module.values():
            plan = plans[units[0].index]
            if len(plan.modules) == 1:
                pre, post = (
                    opaque(partial(self._pre_forward_all, units)),
                    opaque(partial(self._post_forward_all, units)),
                )
                self.handles.append(plan.module.register_forward_pre_hook(pre, with_kwargs=True))
                self.handles.append(plan.module.register_forward_hook(post))
                continue
            run = self.grouped.add(plan.name, plan.member_names, units[-1].index)
            for member, module in enumerate(plan.modules):
                pre = opaque(partial(self._pre_forward_member, units, run, member))
                post = opaque(partial(self._post_forward_member, units, run, member))
                self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self.handles.append(module.register_forward_hook(post))

    def _hook_params(self) -> None:
        """Each parameter's gradient hook: counted before autograd adds into an attached view,
        or handed to its unit after autograd accumulates it."""
        for unit in self.units:
            for position, p in enumerate(unit.params):
                if unit.attached:  # [Note: attached views] in parts/reducer.py
                    index = self.first_index[unit.index] + position
                    hook = partial(self._on_grad_arriving, unit, index)
                    self.handles.append(p.register_hook(hook))
                elif p.requires_grad:
                    hook = partial(self._on_grad, unit, position)
                    self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def _on_grad_arriving(self, unit: FlatUnit, index: int, grad) -> None:
        """Before autograd adds `grad` into its attached view: only checked and counted."""
        unit.check_not_reduced()
        self.round.used[index] = 1

    def _on_grad(self, unit: FlatUnit, position: int, param) -> None:
        unit.on_grad_accumulated(position, divide=self.sync_enabled)
        self.round.mark_used(self.first_index[unit.index] + position)

    # -- forward ------------------------------------------------------------------------------
    def _pre_forward_all(self, units: list[FlatUnit], module, args, kwargs):
        if self.grouped.runs:  # [Note: members in order] in group.py
            self.grouped.opening(units[0].index, units[0].name)
        for unit in units:  # nested: the first opens first and closes last
            args, kwargs = self._pre_forward(unit, module, args, kwargs)
        return args, kwargs

    def _post_forward_all(self, units: list[FlatUnit], module, args, output):
        if self.grouped.open and units[0].index == 0:
            self.grouped.ending()
        for unit in reversed(units):
            self._post_forward(unit, module, args, output)

    def _pre_forward_member(self, units, run: MemberRun, member: int, module, args, kwargs):
        """A module of a grouped unit: the first opens it ([Note: members in order])."""
        if units[0].recomputing():
            return self._pre_forward_all(units, module, args, kwargs)
        if not run.enter(member):
            return None  # a later module: the unit is gathered already
        result = self._pre_forward_all(units, module, args, kwargs)
        self.grouped.open.append(run)
        return result

    def _post_forward_member(self, units, run: MemberRun, member: int, module, args, output):
        """A module of a grouped unit: the last closes it ([Note: members in order])."""
        if units[0].recomputing() or not run.leave(member):
            return
        self.grouped.open.remove(run)
        self._post_forward_all(units, module, args, output)

    def _pre_forward(self, unit: FlatUnit, module, args, kwargs):
        recompute = unit.recomputing()  # [Note: recomputed forward]
        training = torch.is_grad_enabled() and not recompute
        if recompute:
            unit.gather()
        else:
            unit.pre_forward(training, self.schedule.before_forward(unit))
            self.comm.tracer.mark("forward_start", unit=unit.index)
        if self.precision.cast_forward_inputs and self.precision.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), unit.compute_dtype)
        if not training:
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not positions:
            return args, kwargs
        wrapped = PostBackward.apply(
            partial(self._post_backward, unit), *(flat[i] for i in positions)
        )
        for i, t in zip(positions, wrapped, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: FlatUnit, module, args, output):
        if unit.recomputing():
            return  # gathered until its backward is over ([Note: recomputed forward])
        self.comm.tracer.mark("forward_end", unit=unit.index)
        training = torch.is_grad_enabled()
        if training:
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                hook = partial(self._pre_backward, unit)
                register_multi_grad_hook(tensors, hook, mode="any")
        unit.post_forward(reshard=self.schedule.after_forward(unit, training))

    # -- backward -----------------------------------------------------------------------------
    def _pre_backward(self, unit: FlatUnit, grad) -> None:
        self.round.open(self._finish_backward)
        self.schedule.before_backward(unit)
        unit.pre_backward()
        self.comm.tracer.mark("backward_start", unit=unit.index)

    def _post_backward(self, unit: FlatUnit) -> None:
        if not unit.post_backward():
            return  # the unit ran more than once; its other backward passes are still to come
        if self.sync_enabled:
            self.schedule.reduce(unit, self.hook, self.hook_state)
        unit.free()

    def _finish_backward(self) -> None:
        self.comm.tracer.mark("backward_end")
        used = None
        if self.sync_enabled:
            self.schedule.reduce_rest(self.hook, self.hook_state)
            shards = [u.shard for u in self.units]
            used = self.round.finish_agreement(self.round.start_agreement(shards))
        for u in self.units:
            start, stop = self.first_index[u.index], self.first_index[u.index + 1]
            u.finish_round(None if used is None else used[start:stop])
        if used is not None:
            if self.built.owners():  # [Note: whole parameters]: the reduced pieces to the owners
                params = [p for u in self.units for p in u.params]
                self.built.collect_grads({id(p) for p, u in zip(params, used, strict=True) if u})
            self.built.verdict(self.round.nonfinite)  # [Note: torch's own calls]
        self.round.reset()
        self.comm.tracer.mark("reduce_end")

    def rebind(self, group) -> None:
        """Train over another elastic mesh of this model's shard size (`Groups.rebind`); the
        step in progress, whose collectives failed, is abandoned (`FlatUnit.abandon`)."""
        self.groups.rebind(group, self.name)
        for unit in self.units:
            unit.abandon()
            unit.bucket.divisor = self.groups.divisor
        self.schedule.abandon()
        self.round.reset()

    # -- the public calls ---------------------------------------------------------------------
    def build_optimizer(
        self, optimizer_cls, params=None, *, reads: str | list[str] = "element", **kwargs
    ) -> torch.optim.Optimizer:
        """An optimizer over this rank's shard pieces (for the groups whose update reads more
        than an element, over the whole masters it owns, [Note: optimizer layout] in
        parts/optimizer_layout.py), with the user's param groups kept; several per model
        ([Note: built optimizers] in parts/built.py)."""
        if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.LBFGS):
            raise ValueError(
                "build_optimizer: LBFGS takes dot products over all parameters, which ZeRO-3 "
                "shards; it cannot run on shards"
            )
        groups = normalize_param_groups(self.model, params)
        check_new_groups(groups, self.built)
        originals, shard_groups = [], []
        for group in groups:
            originals.append(list(group["params"]))
            pieces = [self.piece_of[id(p)] for p in group["params"] if p.requires_grad]
            shard_groups.append(dict(group, params=[q for q in pieces if q is not None]))
        built = Built(None, originals, reads if isinstance(reads, list) else [reads] * len(groups))
        if any(read != "element" for read in built.reads):
            trainable = [
                [p for p in g if p.requires_grad] if r != "element" else []
                for g, r in zip(originals, built.reads, strict=True)
            ]
            shards = [(u.shard, u.params) for u in self.units]
            name = optimizer_cls.__name__
            built.owners, chosen = own_groups(
                trainable, shards, self.groups.shard, name, built.reads
            )
            for group, masters, read in zip(shard_groups, chosen, built.reads, strict=True):
                if read != "element":
                    group["params"] = masters
        optimizer = built.optimizer = optimizer_cls(shard_groups, **kwargs)
        to_local = partial(self._to_local, optimizer)
        device = self.comm.device
        built.calls = OptimizerCalls(optimizer, self.name, to_local, self.refresh_params, device)
        optimizer.register_step_pre_hook(lambda *_: self._reconcile())
        optimizer.register_step_post_hook(lambda *_: built.after_step(self.groups.shard))
        self.built.add(built)
        return optimizer

    def _reconcile(self) -> None:
        """[Note: sharded gradients]: a `.grad` the user set to None clears that gradient."""
        for unit in self.units:
            unit.sharded_grads.reconcile()

    def shard_holders(self) -> list[FlatUnit]:
        return self.units

    def geometry(self, optimizer: torch.optim.Optimizer | None = None) -> Geometry:
        """Each unit's shard pieces, in the units' master dtype ([Note: geometry])."""
        if optimizer is not None:
            self.built.of(optimizer)
        dtypes = {id(p): u.dtype for u in self.units for p in u.params}
        shards = [(u.shard, u.params) for u in self.units]
        owned = self.built.masters()
        return build_geometry(
            self.model, shards, self.groups.shard, optimized_ids(optimizer), dtypes, owned
        )

    def refresh_params(self) -> None:
        for owners in self.built.owners():  # the owners' masters into the shards
            owners.send_values()
        for unit in self.units:
            unit.free()  # the next forward gathers the shards the optimizer holds

    def working_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        held = [u.held_tensors() for u in self.units]
        return [t for p, _ in held for t in p], [t for _, g in held for t in g]

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """As every strategy's; `largest_gathered_unit` is the largest buffer a gather has
        allocated so far (the transient on top of the rest)."""
        report = super().memory_report(optimizer)
        report["largest_gathered_unit"] = max(u.largest_gathered for u in self.units)
        return report

"""One ZeRO-3 unit: a flat sharded parameter that owns its life cycle.

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
parameter outside its unit's forward gives NaN (not a crash: a view of the freed storage would
read freed memory and crash the process), writing to it raises. Use `dp.full_state_dict(model)`
to read weights. Code that is compiled (`torch.compile`) only ever runs on gathered parameters:
the unit's hooks are opaque to the compiler ([Note: compile] in strategy.py), so a compiled region
starts after the pre-forward hook and ends before the post-forward hook, and its guards see
the gathered views, the same shape and strides every step.

[Note: unit life cycle] Two states, each an enum set in one place:
- `ShardedState` (the parameters): SHARDED -> GATHERING (an all-gather in flight into the
  buffer) -> GATHERED (the parameters view the buffer) -> SHARDED (`free`).
- `TrainingState` (the step): IDLE -> FORWARD (`pre_forward`, once per forward of the unit; a
  unit run k times waits for k backward passes) -> BACKWARD (`pre_backward`: gradients come
  into the bucket) -> REDUCING (`start_reduce`) -> REDUCED (`finish_reduce`) -> IDLE
  (`finish_round`). Under `no_sync` the round ends from BACKWARD without a reduction.

Gradients: a unit's gradients land in a lazy `Bucket` (parts/buckets.py, the same one ZeRO-1/2
and DDP use). At `pre_backward` its views become the parameters' `.grad` and autograd adds into
them in place ([Note: attached views] in parts/reducer.py; a unit with a frozen parameter, or
whose bucket is wider than its parameters, copies each gradient in instead), and the bucket is
divided for the mean once, at launch. The strategy's hook reduces it the strategy's hook reduces to this rank's shard ([Note: reduction interface]
in comm/hooks.py); the shard keeps the result in its dtype (fp32 under mixed precision) and the
bucket is freed, as ZeRO-2 does with its buckets.
"""

from __future__ import annotations

import enum

import torch

from ...comm import Comm, HookState
from ...torch_internals import in_backward
from ..parts.buckets import Bucket, BucketSpec
from ..parts.flat_shard import FlatShard, shard_values
from ..parts.held_grads import ShardedGrads
from ..parts.layout import ShardLayout
from ..parts.sharded_grads import is_sharded_grad
from .plan import UnitPlan


class ShardedState(enum.Enum):
    """Where a unit's parameters are ([Note: unit life cycle])."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class TrainingState(enum.Enum):
    """Where a unit is in the step ([Note: unit life cycle])."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    REDUCING = "reducing"
    REDUCED = "reduced"


class FlatUnit:
    """The parameters of one module, flattened and sharded across the shard group.

    index: the unit's position in the strategy's plan (the root is 0).
    plan: which module and parameters (plan.py).
    comm: the shard group.
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
        rank = comm.rank
        values = [p.detach() for p in self.params]
        data = shard_values(self.layout, rank, values, self.dtype, self.device)
        self.shard = FlatShard(self.layout, rank, data, [p.requires_grad for p in self.params])
        self.sharded_grads = ShardedGrads(self.params, "zero3")  # [Note: sharded gradients]
        self._new_buffer()
        self.nan = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.device)
        self.at_rest = [self.nan.expand(p.shape) for p in self.params]  # made once, reused
        self._rest()
        spec = BucketSpec(
            index,
            tuple(range(len(self.params))),
            self.layout.offsets,
            self.layout.numel,
            bucket_dtype or self.compute_dtype,
            self.device,
        )
        self.bucket = Bucket(spec, self.params, True, divisor, self.layout.shard_range(rank))
        # [Note: attached views] in parts/reducer.py: autograd adds into the bucket itself
        self.attached = self.bucket.grad_views and all(p.requires_grad for p in self.params)
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.pending_backwards = 0  # forwards whose backward has not run yet
        self._gather_work = None
        self._gather_source: torch.Tensor | None = None
        self.largest_gathered = 0

    def _new_buffer(self) -> None:
        """The gathered buffer (no memory until a gather) and the parameters' views into it."""
        self.full = torch.empty(self.layout.numel, dtype=self.compute_dtype, device=self.device)
        self.views = [
            self.full[off : off + p.numel()].view(shape)
            for p, off, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True)
        ]
        self.full.untyped_storage().resize_(0)

    def abandon(self) -> None:
        """After a round whose collectives failed (live recovery moves the model to another
        group: `ZeRO3Strategy.rebind`): what was in flight is left to the old group, and the
        unit starts the next round at rest, in new buffers (a late write lands in the old)."""
        self._gather_work = self._gather_source = None
        self._new_buffer()
        self._rest()
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.pending_backwards = 0
        self.bucket.release()
        self.bucket.reset()

    @property
    def empty(self) -> bool:
        return self.layout.numel == 0

    @property
    def frozen(self) -> bool:
        """No parameter of the unit takes a gradient: nothing to reduce or hold."""
        return not any(p.requires_grad for p in self.params)

    def _rest(self) -> None:
        for p, rest in zip(self.params, self.at_rest, strict=True):
            p.data = rest  # [Note: parameters at rest]

    # -- parameters -------------------------------------------------------------------------
    def start_gather(self, prefetch: bool = False) -> None:
        """Start the all-gather of the shards into the unit's buffer (no-op unless SHARDED)."""
        if self.sharded_state is not ShardedState.SHARDED or self.empty:
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
        self.sharded_state = ShardedState.GATHERING

    def gather(self) -> None:
        """Make the parameters usable: finish (or start and finish) the gather, point them at it."""
        if self.sharded_state is ShardedState.GATHERED or self.empty:
            return
        self.start_gather()
        if self._gather_work is not None:
            self.comm.tracer.mark("gather_wait", unit=self.index)
            self._gather_work.wait()
        self._gather_work = self._gather_source = None
        self.comm.tracer.mark("gather_end", unit=self.index)
        for p, view in zip(self.params, self.views, strict=True):
            p.data = view
        self.sharded_state = ShardedState.GATHERED

    def free(self) -> None:
        """Release the gathered buffer; the parameters go back to rest."""
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self._gather_work is not None:
            self._gather_work.wait()  # never free a buffer a collective still writes
        self._gather_work = self._gather_source = None
        self._rest()
        self.full.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED

    # -- the verbs of a step ([Note: unit life cycle]) --------------------------------------
    def pre_forward(self, training: bool, gather: bool = True) -> None:
        """Gather (the schedule may have started it) and, in training, expect one more
        backward. Without `gather` (a rank off the agreed order, [Note: same units on every
        rank]) the parameters stay at rest: this forward is then reported as an error."""
        if gather:
            self.gather()
        if training:
            self.sharded_grads.drop()
            self.training_state = TrainingState.FORWARD
            self.pending_backwards += 1

    def post_forward(self, reshard: bool) -> None:
        if reshard:
            self.free()

    def pre_backward(self) -> None:
        """Gather again; gradients that exist (kept across `no_sync` backwards) come into the
        bucket, fresh ones arrive in `on_grad_accumulated`."""
        self.gather()
        if self.training_state is TrainingState.FORWARD:
            self.training_state = TrainingState.BACKWARD
            if self.empty:
                return
            if not self.attached:
                if any(p.grad is not None for p in self.params):
                    self.bucket.attach_grads()
            elif self.bucket.buffer is None and all(p.grad is None for p in self.params):
                self.bucket.allocate_attached()
            else:
                self.bucket.attach_views()

    def post_backward(self) -> bool:
        """One backward of the unit is over; True when it was the last one this round."""
        self.pending_backwards -= 1
        return self.pending_backwards <= 0

    def recomputing(self) -> bool:
        """[Note: recomputed forward] A unit's forward run by autograd inside its backward:
        whole-unit activation checkpointing, `checkpoint(block, x, use_reentrant=False)`,
        recomputes the module's `__call__`, hooks included. Its parameters are gathered for the
        backward it serves (or gathered now, for a unit nested in a recomputed one) and its step
        is already scheduled: the recompute is compute only, with no backward to expect, no
        order entry and no free (which would pull the storage from under the tensors it saves).
        Reentrant checkpointing runs the first forward without gradients, so no backward was
        scheduled: refused."""
        if not in_backward():
            return False
        if self.training_state is TrainingState.IDLE and torch.is_grad_enabled():
            raise RuntimeError(
                f"ZeRO3: unit '{self.name}' was recomputed in backward after a forward without "
                "gradients (reentrant activation checkpointing); pass use_reentrant=False to "
                "torch.utils.checkpoint (dp.checkpoint_activations does)"
            )
        return self.training_state is not TrainingState.IDLE

    def check_not_reduced(self) -> None:
        if self.training_state in (TrainingState.REDUCING, TrainingState.REDUCED):
            raise RuntimeError(
                f"ZeRO3: a gradient of unit '{self.name}' arrived after the unit was reduced; "
                "does a module outside the unit use its parameters? wrap differently"
            )

    def on_grad_accumulated(self, position: int, divide: bool) -> None:
        """A unit without attached views: the gradient autograd stored comes into the bucket."""
        self.check_not_reduced()
        self.bucket.adopt_grad(position, divide=divide)

    @property
    def needs_reduce(self) -> bool:
        return self.training_state not in (TrainingState.REDUCING, TrainingState.REDUCED)

    def start_reduce(self, hook, state: HookState) -> None:
        """Start reducing the unit's gradients to this rank's shard ([Note: reduction
        interface]); the parameters' .grad are dropped (the shard will hold the result)."""
        if self.empty or self.frozen:
            self.training_state = TrainingState.REDUCED
            return
        self.training_state = TrainingState.REDUCING
        self.comm.tracer.mark("reduce_start", unit=self.index)
        with self.comm.tracer.labelled(unit=self.index):
            self.bucket.launch(hook, state)
        for p in self.params:
            p.grad = None

    def finish_reduce(self) -> None:
        """Wait for the reduction and add this rank's averaged part into the shard's gradient."""
        if self.training_state is not TrainingState.REDUCING:
            return
        self.bucket.wait()
        self.comm.tracer.mark("reduce_end", unit=self.index)
        self.shard.take_reduced(self.bucket.reduced())
        self.bucket.release()
        self.bucket.reset()
        self.training_state = TrainingState.REDUCED

    def finish_round(self, used: list[bool] | None) -> None:
        """The backward is over (`used`: per parameter, whether some rank used it; None under
        `no_sync`): pieces of used parameters get their .grad, and the unit is freed."""
        if used is not None:
            self.shard.attach_grads(used)
            self.sharded_grads.attach(used)
        self.training_state = TrainingState.IDLE
        self.pending_backwards = 0
        self.free()

    # -- what this rank holds ---------------------------------------------------------------
    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameter storages, gradient storages) this unit holds right now."""
        params = [self.shard.data, self.full]
        held = [p.grad for p in self.params if p.grad is not None]
        grads = [self.shard.store] + [g for g in held if not is_sharded_grad(g)]
        if self.bucket.buffer is not None:
            grads.append(self.bucket.buffer)
        return params, grads


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward calls back once their gradient exists."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)

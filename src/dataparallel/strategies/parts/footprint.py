"""What one rank holds under a strategy, from the plans the strategy itself runs; no process
group, nothing allocated.

[Note: footprint] Each policy (`DDP`, `ZeRO1`/`ZeRO2`, `ZeRO3`) answers `footprint(shapes,
...)`: the bytes one rank holds for a model of `shapes`, computed by the planners its strategy
runs at wrap time, with the policy's own knobs: `plan_buckets` with its `bucket_mb` and
`first_bucket_mb`, padded to the shard group's size (DDP, ZeRO-1/2), `ShardLayout.pack` over
ZeRO-3's units, this rank's pieces of each layout (`ShardLayout.pieces`: what its optimizer
steps), and the reductions the strategy keeps in flight (zero12/strategy.py's `MAX_IN_FLIGHT`,
ZeRO-3's one reduction at a time). DDP with a low `param_dtype` is ZeRO-1 on shard groups of one
rank (docs/ddp.md) and is counted as that. The planner (plan/strategies.py) asks the policies and
copies none of it; tests/dist/test_footprint.py holds the held terms against
`dp.memory_report` on every strategy and mesh, to the byte.

What is not counted: frozen parameters (the shapes are the trainable ones; the planner adds
them, [Note: planner LoRA] in plan/lora.py), normalisation
layers held in fp32 under a low `param_dtype` (their own buckets and units), optimizer state
that is not per element (Adam's 4-byte `step` per tensor), and compression state (the hook's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buckets import plan_buckets
from .layout import ShardLayout
from .precision import MixedPrecision


@dataclass(frozen=True)
class ParamShapes:
    """What a footprint knows of a model.

    numels: each trainable parameter's number of elements, in registration order (buckets are
        planned over them in reverse, [Note: bucket order] in buckets.py).
    units: ZeRO-3's units, the root first (`plan_units` in zero3/plan.py): the numels of the
        parameters each unit owns, in its flat order. Empty: one root unit owning everything.
    frozen_units: per unit of `units`, the elements of its parameters that take no gradient
        (a LoRA base): not in `numels` or `units`; the planner adds them ([Note: planner
        LoRA] in plan/lora.py). Empty when none is frozen.
    """

    numels: tuple[int, ...]
    units: tuple[tuple[int, ...], ...] = ()
    frozen_units: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """Bytes one rank holds (the shard group's rank `rank` of the call; rank 0, whose shards
    carry no padding, holds the most).

    params: parameter storage between steps: the whole model in the compute dtype (DDP,
        ZeRO-1/2's flat buffers, padding included), or this rank's shards in the model's dtype
        (ZeRO-3: the masters are the shard).
    grads: gradient storage between steps: DDP's and ZeRO-1's full buckets, the shard's own
        gradient (ZeRO-1 only where its dtype differs from the bucket's, otherwise it is a view
        of the bucket; ZeRO-2 and ZeRO-3 keep only that).
    optimizer: per-element optimizer state: `optimizer_bytes` x the elements this rank steps
        (its pieces, padding excluded). Masters are not in it.
    masters: fp32 master copies of this rank's slices (ZeRO-1/2 under a low `param_dtype`).
    in_flight: transient buffers at the step's peak: gradient buckets (units) being filled or
        reduced that are not held, the receive buffers of pairwise reduce-scatters, and
        ZeRO-3's gathered units (`gathered`, part of it).
    gathered: ZeRO-3's gathered parameters at the peak: the root, the unit computing and the
        one prefetched (all units when the policy does not reshard after forward).
    reductions: bytes of each gradient buffer reduced per step (a bucket, a unit), full size
        in the bucket dtype, in launch order: what the collectives carry.
    gathers: bytes of each flat buffer all-gathered (ZeRO-1/2: every bucket after the step;
        ZeRO-3: every unit, in forward), in the compute dtype.
    """

    params: int
    grads: int
    optimizer: float
    masters: int = 0
    in_flight: float = 0.0
    gathered: float = 0.0
    reductions: tuple[int, ...] = ()
    gathers: tuple[int, ...] = ()

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer + self.masters


def dtypes(precision: MixedPrecision, model_dtype: torch.dtype) -> tuple:
    """(compute, masters or None, bucket, wire) dtypes under `precision` ([Note: mixed
    precision] in precision.py)."""
    compute = precision.compute_dtype(model_dtype)
    bucket = precision.bucket_dtype(compute)
    return compute, precision.masters(model_dtype), bucket, precision.wire_dtype(compute) or bucket


def bucket_layouts(
    numels: tuple[int, ...],
    dtype: torch.dtype,
    bucket_bytes: int,
    first_bucket_bytes: int,
    shards: int,
) -> list[ShardLayout]:
    """The buckets a bucketed strategy plans for parameters of `numels` in `dtype` (planned in
    reverse, padded to `shards`), each as the layout its shard group splits."""
    backward = list(reversed(numels))
    specs = plan_buckets(
        [(n, dtype, "cpu") for n in backward],
        bucket_bytes=bucket_bytes,
        first_bucket_bytes=first_bucket_bytes,
        pad_to=shards,
    )
    return [
        ShardLayout(tuple(backward[i] for i in s.param_indices), s.offsets, s.numel, shards)
        for s in specs
    ]


def stepped(layouts: list[ShardLayout], rank: int) -> int:
    """Elements of the pieces `rank` holds: what its optimizer steps (padding excluded)."""
    return sum(piece.numel for layout in layouts for piece in layout.pieces(rank))


def received(layout: ShardLayout, dtype: torch.dtype) -> int:
    """Bytes of a pairwise reduce-scatter's receive buffer for `layout` (one shard from each
    peer, comm/pairwise.py)."""
    return (layout.world_size - 1) * layout.shard_numel * dtype.itemsize


def bucketed(
    shapes: ParamShapes,
    precision: MixedPrecision,
    *,
    stage: int,
    bucket_bytes: tuple[int, int],
    shards: int,
    in_flight: int,
    pairwise: bool,
    optimizer_bytes: float,
    model_dtype: torch.dtype = torch.float32,
    rank: int = 0,
) -> Footprint:
    """DDP (stage 0), ZeRO-1 (1: full buckets kept) and ZeRO-2 (2: buckets freed once their
    shard is kept, `in_flight` reducing plus one filling). bucket_bytes: the policy's (bucket,
    first bucket) sizes; in_flight: reductions the reducer keeps in flight (`max_in_flight`);
    pairwise: reduce-scatters are pairwise, each holding a receive buffer. optimizer_bytes:
    per-element optimizer state (Adam 8); model_dtype: the parameters' dtype before the
    policy's precision; rank: the shard group's rank counted."""
    compute, master, bucket, wire = dtypes(precision, model_dtype)
    layouts = bucket_layouts(shapes.numels, compute, *bucket_bytes, shards)
    full = sorted(layout.numel * bucket.itemsize for layout in layouts)
    params = sum(layout.numel for layout in layouts) * compute.itemsize
    reductions = tuple(layout.numel * bucket.itemsize for layout in layouts)
    if stage == 0:
        return Footprint(
            params=params,
            grads=sum(full),
            reductions=reductions,
            optimizer=optimizer_bytes * sum(shapes.numels),
        )
    held = master or compute  # the shard's data, and its gradient store
    shard = sum(layout.shard_numel for layout in layouts)
    store = shard * held.itemsize
    grads = sum(full) + (store if held != bucket else 0) if stage == 1 else store
    receive = max((received(layout, wire) for layout in layouts), default=0)
    transient = in_flight * receive if pairwise and shards > 1 else 0
    if stage == 2:
        transient += sum(full[-(in_flight + 1) :])
    return Footprint(
        params=params,
        grads=grads,
        optimizer=optimizer_bytes * stepped(layouts, rank),
        masters=shard * master.itemsize if master is not None else 0,
        in_flight=transient,
        reductions=reductions,
        gathers=tuple(layout.numel * compute.itemsize for layout in layouts),
    )


def unitwise(
    shapes: ParamShapes,
    precision: MixedPrecision,
    *,
    shards: int,
    gathered_units: int | None,
    pairwise: bool,
    optimizer_bytes: float,
    model_dtype: torch.dtype = torch.float32,
    rank: int = 0,
) -> Footprint:
    """ZeRO-3: per unit, a flat shard in the model's dtype and a gradient store of the same;
    at the peak the root and `gathered_units` more units gathered (None: all), the unit whose
    backward fills its gradients and the one reducing (one at a time, [Note: schedule] in
    zero3/strategy.py)."""
    compute, _, bucket, wire = dtypes(precision, model_dtype)
    held = model_dtype
    units = shapes.units or (shapes.numels,)
    layouts = [ShardLayout.pack(list(unit), shards) for unit in units]
    shard = sum(layout.shard_numel for layout in layouts) * held.itemsize
    others = sorted((layout.numel for layout in layouts[1:]), reverse=True)
    gathered = (layouts[0].numel + sum(others[:gathered_units])) * compute.itemsize
    largest = max(layouts, key=lambda layout: layout.numel)
    transient = gathered + 2 * largest.numel * bucket.itemsize
    transient += received(largest, wire) if pairwise and shards > 1 else 0
    return Footprint(
        params=shard,
        grads=shard,
        optimizer=optimizer_bytes * stepped(layouts, rank),
        in_flight=transient,
        gathered=gathered,
        reductions=tuple(layout.numel * bucket.itemsize for layout in layouts),
        gathers=tuple(layout.numel * compute.itemsize for layout in layouts),
    )

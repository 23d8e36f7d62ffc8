"""ZeRO-1/2's flat parameter buffers, and the optimizer step over this rank's shards of them.

[Note: sharded step] Each bucket's parameters are laid end to end in a flat buffer (the model's
parameters become views into it) and rank r of the shard group owns the r-th slice: one
`FlatShard` per bucket ([Note: flat shard] in parts/flat_shard.py), whose `data` is that slice
itself, or its fp32 master copy in mixed precision. The optimizer is the user's class over the
shards' pieces. Its step pre-hook only makes sure the parameter gather of the last step is over;
the post-hook writes updated masters back into the compute-dtype slice and all-gathers the
buffers, so every rank's model holds the new full parameters when `step()` returns (with
`overlap_param_gather`, by the time the next forward reads them: parts/param_gather.py). A step
the loss scaler skips runs neither hook: nothing changes on any rank ([Note: found inf]).

The optimizer keeps one tensor per piece (its param groups, per-parameter scalars and state are
the plain optimizer's), and an elementwise class steps each run of a shard's pieces as one
tensor ([Note: flat step] in parts/flat_step.py): on gpt-deep-narrow's 388 tensors torch's
AdamW loop took 5.7 ms of ZeRO-1's step per piece and 2.2 ms flat.
"""

from __future__ import annotations

import torch

from ...comm import Comm
from ..parts.buckets import BucketSpec
from ..parts.flat_shard import FlatShard, shard_values
from ..parts.layout import ShardLayout
from ..parts.param_gather import ParamGather


class BucketShard:
    """One bucket's flat parameter buffer and this rank's `FlatShard` of it.

    flat: the flat parameter buffer in the compute dtype; the model's parameters view it.
    own: this rank's slice of `flat`.
    shard: the optimizer's view of the slice (`own`, or an fp32 master copy).
    params: the model parameters in the bucket, in layout order.
    optimized: whether the optimizer steps it (False for parameters outside every group).
    grads: the reducer's gradient `Bucket` of the same parameters (set once the reducer is
        built), which the stage's keeper reduces into `shard`.
    """

    def __init__(self, flat, layout: ShardLayout, rank: int, master, params, optimized: bool):
        self.flat = flat
        self.params = params
        self.optimized = optimized
        self.grads = None
        start, stop = layout.shard_range(rank)
        self.own = flat[start:stop]
        data = self.own if master is None else master
        self.shard = FlatShard(layout, rank, data, [p.requires_grad for p in params])

    @property
    def has_master(self) -> bool:
        return self.shard.data is not self.own

    @torch.no_grad()
    def write_back(self) -> None:
        """After the step: the updated master slice into the compute-dtype buffer."""
        if self.has_master:
            self.own.copy_(self.shard.data)


@torch.no_grad()
def flatten_bucket(
    spec: BucketSpec,
    params: list[torch.nn.Parameter],
    values: dict[int, torch.Tensor],
    rank: int,
    shards: int,
    master_dtype: torch.dtype | None,
    optimized: bool,
) -> BucketShard:
    """Lay `params` end to end in a new flat buffer of `spec.dtype`, make them views into it,
    and build this rank's shard. `values` (id(param) -> tensor) replaces a parameter's current
    value: the fp32 masters when the parameters themselves are low precision."""
    layout = ShardLayout(tuple(p.numel() for p in params), spec.offsets, spec.numel, shards)
    flat = torch.zeros(spec.numel, dtype=spec.dtype, device=spec.device)
    full = [values.get(id(p), p.detach()).reshape(-1) for p in params]
    master = None
    if master_dtype is not None:
        master = shard_values(layout, rank, full, master_dtype, spec.device)
    for p, offset, value in zip(params, spec.offsets, full, strict=True):
        flat[offset : offset + p.numel()].copy_(value)
        p.data = flat[offset : offset + p.numel()].view_as(p)
    return BucketShard(flat, layout, rank, master, params, optimized)


class ShardedStep:
    """The step hooks of [Note: sharded step].

    The all-gather that follows the update is `gather`'s, over the optimized buckets: within
    `step()`, or, given `overlap_with` (the model), overlapped with its next forward, whose
    modules get the hooks that wait ([Note: overlapped parameter gather] in param_gather.py).
    """

    def __init__(self, buckets: list[BucketShard], comm: Comm, overlap_with=None):
        self.buckets = [b for b in buckets if b.optimized]
        self.gather = ParamGather(
            [(b.flat, b.own) for b in self.buckets], comm, overlap=overlap_with is not None
        )
        if overlap_with is not None:
            self.gather.attach(overlap_with)

    def before(self, optimizer, args, kwargs) -> None:
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            # The closure's backward would reduce into the shards while the step reads them.
            raise ValueError(
                "step(closure) is not supported with ZeRO-1/2: run forward and backward, "
                "then call step() without a closure"
            )
        self.gather.finish()  # the slices this step updates must be whole and settled

    def detach(self) -> None:
        """The buckets were laid out again: this step's gather and its hooks go."""
        self.gather.detach()

    def after(self, optimizer, args, kwargs) -> None:
        for bucket in self.buckets:
            bucket.write_back()
        self.gather.start()  # every rank's updated slices into every rank's flat buffers

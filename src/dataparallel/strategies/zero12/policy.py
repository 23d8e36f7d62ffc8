"""ZeRO-1 and ZeRO-2's policies: what `dp.ZeRO1(...)` and `dp.ZeRO2(...)` take, check and build
(the strategy is in strategy.py).

Their contract, and the notes their fields name, are strategy.py's module docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..parts.buckets import MB
from ..parts.footprint import Footprint, bucketed
from ..parts.keepers import FreeBuckets, KeepBuckets
from ..parts.mesh import Groups
from ..parts.precision import MixedPrecision, check_precision
from .strategy import MAX_IN_FLIGHT, ZeROStrategy


@dataclass(frozen=True, kw_only=True)
class ZeROPolicy:
    """The knobs ZeRO1 and ZeRO2 share.

    bucket_mb: gradient bucket size in MiB (also the unit of sharding and of the parameter
        all-gather). Must be > 0.
    first_bucket_mb: size of the first bucket, kept small so reduction starts early in
        backward. Must be > 0.
    precision: a `MixedPrecision` ([Note: mixed precision] in parts/precision.py); None trains
        in the model's own dtype, with no extra copy (the optimizer updates this rank's slice
        of the parameters in place).
    grad_reduce: "reduce_scatter" sends each rank only its slice of a bucket (half an
        all-reduce's bytes); "all_reduce" reduces the whole bucket everywhere, each rank keeps
        its slice; "auto": reduce_scatter, pairwise on gloo (docs/zero.md), or all_reduce
        under `parallelize(..., pairwise=False)`, gloo's own reduce-scatter being the slower.
    comm_hook: `hook(state, bucket) -> future` reducing one bucket ([Note: reduction interface]
        in comm/hooks.py); None picks the built-in one `grad_reduce` and `precision` name.
    hook_state: passed to `comm_hook`; None builds a `HookState` for the strategy's groups.
    broadcast_buffers: broadcast buffers from rank 0 at each training forward (as DDP).
    overlap_param_gather: True: `step()` only launches the parameter all-gathers, and each
        module's forward waits for the buckets it reads; code that reads or writes parameters
        between `step()` and the next forward calls `dataparallel.finish_param_gather(model)`
        first ([Note: overlapped parameter gather] in param_gather.py). False: whole at once.
    """

    name: ClassVar[str] = "zero"
    keeper: ClassVar[type] = KeepBuckets
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    precision: MixedPrecision | None = None
    grad_reduce: str = "auto"
    comm_hook: Callable | None = None
    hook_state: object | None = None
    broadcast_buffers: bool = True
    overlap_param_gather: bool = False

    def __post_init__(self):
        who = type(self).__name__
        if type(self) is ZeROPolicy:
            raise ValueError(f"{who}: use ZeRO1 or ZeRO2 (this policy names no ZeRO stage)")
        if not self.bucket_mb > 0:
            raise ValueError(f"{who}: bucket_mb={self.bucket_mb} must be > 0 (MiB per bucket)")
        if not self.first_bucket_mb > 0:
            raise ValueError(f"{who}: first_bucket_mb={self.first_bucket_mb} must be > 0")
        object.__setattr__(self, "precision", check_precision(self.precision, who))
        if self.grad_reduce not in ("auto", "reduce_scatter", "all_reduce"):
            raise ValueError(
                f"{who}: grad_reduce={self.grad_reduce!r} must be 'auto', 'reduce_scatter' "
                "or 'all_reduce'"
            )

    def collective_for(self, comm, device: torch.device) -> str:
        """The gradient collective `grad_reduce` means on `comm`, for gradients on `device`."""
        return comm.sharded_reduce(device) if self.grad_reduce == "auto" else self.grad_reduce

    def apply(self, model: nn.Module, groups: Groups) -> ZeROStrategy:
        return ZeROStrategy(model, groups, self)

    def footprint(self, shapes, *, shard_size: int, pairwise: bool = True, **given) -> Footprint:
        """Bytes one rank of a shard group of `shard_size` holds ([Note: footprint] in
        parts/footprint.py; `given`: `bucketed`'s optimizer_bytes, model_dtype, rank)."""
        return bucketed(
            shapes,
            self.precision,
            stage=2 if self.keeper.lazy else 1,
            shards=shard_size,
            bucket_bytes=(int(self.bucket_mb * MB), int(self.first_bucket_mb * MB)),
            in_flight=MAX_IN_FLIGHT,
            pairwise=pairwise and self.grad_reduce != "all_reduce",
            **given,
        )


@dataclass(frozen=True, kw_only=True)
class ZeRO1(ZeROPolicy):
    """ZeRO stage 1: optimizer state sharded, full gradients kept. Fields: see ZeROPolicy."""

    name: ClassVar[str] = "zero1"
    keeper: ClassVar[type] = KeepBuckets


@dataclass(frozen=True, kw_only=True)
class ZeRO2(ZeROPolicy):
    """ZeRO stage 2: optimizer state and gradients sharded. Fields: see ZeROPolicy, except
    that `bucket_mb` defaults to 4."""

    name: ClassVar[str] = "zero2"
    keeper: ClassVar[type] = FreeBuckets
    # Smaller than ZeRO-1's: less full-gradient memory in flight, and a freed bucket's memory is
    # reused by the next instead of being faulted back in every step (docs/zero.md, bucket_mb).
    bucket_mb: float = 4.0

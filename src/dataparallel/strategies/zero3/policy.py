"""ZeRO-3's policy: what `dp.ZeRO3(...)` takes, checks and builds (the strategy is in strategy.py).

Its contract, and the notes its fields name, are strategy.py's module docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ..parts.footprint import Footprint, unitwise
from ..parts.mesh import Groups
from ..parts.precision import MixedPrecision, check_precision
from .order import CHECK_MODES
from .plan import MIN_UNIT_PARAMS
from .strategy import ZeRO3Strategy

REDUCE_KINDS = ("auto", "reduce_scatter", "all_reduce")


@dataclass(frozen=True, kw_only=True)
class ZeRO3:
    """Policy for ZeRO stage 3 (fully sharded data parallelism).

    wrap: which submodules become units, gathered and freed together: a tuple of module
        classes, a callable `module -> bool`, or None for every child of an nn.ModuleList
        (each `Block` of our GPT). Parameters outside every unit belong to the root unit (the
        model), which stays gathered from the start of forward to the end of backward.
    prefetch: how many units ahead to gather while the current unit computes, in forward
        (in the previous step's order) and in backward (in reverse): True (1) the next one,
        False (0) none, 2 the next two (one more unit gathered at the peak).
    reshard_after_forward: free each unit after its forward and gather it again for its
        backward (except the unit that ran last in the previous step's forward, whose backward
        comes right after); False keeps every unit gathered from its forward to its backward
        (one gather less per unit, the memory of the whole model at the end of forward).
    precision: a `MixedPrecision`; None computes in the parameters' own dtype. With
        `param_dtype=torch.bfloat16` units are gathered, computed and reduced in bf16 while
        master weights, gradient shards and optimizer state stay fp32 (module docstring).
    reduce: how gradients are averaged: "reduce_scatter" (each rank receives its shard, the
        ZeRO collective, half the bytes), "all_reduce" (every rank receives everything and
        keeps its shard), or "auto": reduce_scatter, from point-to-point messages on gloo
        ([Note: pairwise collectives] in comm/pairwise.py); all_reduce on gloo when
        `parallelize(..., pairwise=False)`, as gloo's own reduce-scatter is the slower there.
    comm_hook: `hook(state, bucket) -> future` reducing one unit's gradients ([Note: reduction
        interface] in comm/hooks.py); None picks the built-in one `reduce` names.
    hook_state: passed to `comm_hook`; None builds a `HookState` for the strategy's groups.
    check_order: how every rank is kept to one order of unit gathers, so that a unit some
        ranks skip stops every rank with one error instead of a hang ([Note: same units on
        every rank] in order.py): "auto" checks each unit's forward (one all-gather of
        one integer per rank) until two forwards in a row ran the same order, then follows
        that order with one check per forward (an order that then changes is an error, even
        if alike on every rank); "always" checks each unit's forward every step (an order
        that changes alike on every rank works); "off" checks nothing.
    materialize: for a model whose parameters are on the meta device (built without memory),
        `materialize(params)` gives the listed parameters their values in place (the same
        Parameter objects, e.g. by `torch.utils.swap_tensors`). It is called unit by unit, just
        before each unit is sharded, and the unit's values are then broadcast from rank 0, so
        no rank ever holds more than one unit's whole parameters; None: they are real already.
    """

    name: ClassVar[str] = "zero3"
    wrap: Callable[[nn.Module], bool] | tuple[type, ...] | None = None
    min_unit_params: int = MIN_UNIT_PARAMS
    prefetch: bool | int = True
    reshard_after_forward: bool = True
    precision: MixedPrecision | None = None
    reduce: str = "auto"
    comm_hook: Callable | None = None
    hook_state: object | None = None
    check_order: str = "auto"
    materialize: Callable | None = None

    def __post_init__(self):
        if isinstance(self.wrap, type):  # wrap=Block means wrap=(Block,), not Block(module)
            object.__setattr__(self, "wrap", (self.wrap,))
        if self.wrap is not None and not callable(self.wrap):
            if not isinstance(self.wrap, tuple) or not all(
                isinstance(c, type) and issubclass(c, nn.Module) for c in self.wrap
            ):
                raise ValueError(
                    f"ZeRO3: wrap={self.wrap!r} must be None, a tuple of nn.Module classes, or "
                    "a callable module -> bool"
                )
        if (
            not isinstance(self.min_unit_params, int)
            or isinstance(self.min_unit_params, bool)
            or self.min_unit_params < 0
        ):
            raise ValueError(
                f"ZeRO3: min_unit_params={self.min_unit_params!r} must be a number of "
                "parameters >= 0 (0: every module its own unit)"
            )
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(
                f"ZeRO3: prefetch={self.prefetch!r} must be True, False or a number of units >= 0"
            )
        object.__setattr__(self, "precision", check_precision(self.precision, "ZeRO3"))
        if self.reduce not in REDUCE_KINDS:
            raise ValueError(f"ZeRO3: reduce={self.reduce!r} must be one of {REDUCE_KINDS}")
        if self.check_order not in CHECK_MODES:
            raise ValueError(
                f"ZeRO3: check_order={self.check_order!r} must be one of {CHECK_MODES}"
            )

    def apply(self, model: nn.Module, groups: Groups) -> ZeRO3Strategy:
        return ZeRO3Strategy(model, groups, self)

    def footprint(self, shapes, *, shard_size: int, pairwise: bool = True, **given) -> Footprint:
        """Bytes one rank of a shard group of `shard_size` holds ([Note: footprint] in
        parts/footprint.py; `given`: `unitwise`'s optimizer_bytes, model_dtype, rank)."""
        return unitwise(
            shapes,
            self.precision,
            shards=shard_size,
            pairwise=pairwise and self.reduce != "all_reduce",
            gathered_units=1 + int(self.prefetch) if self.reshard_after_forward else None,
            **given,
        )

"""DCP's global save plan over every rank's plan, checked in time linear in the world.

What the coordinator of a sharded save runs (`ChunkSavePlanner.create_global_plan`, dcp.py):
torch 2.13's `DefaultSavePlanner._create_global_plan` step for step (remove the items several
ranks write, build the global plan and its metadata, keep the ranks' nestings, check every
tensor's boxes), with two changes measured at 4,096 ranks (BENCHMARKS.md, "Cost as the world
grows"): the check of each tensor's boxes is `tiles` ([Note: tiling check] in rectangles.py),
DCP's own only where that cannot vouch for them, and the ranks' nestings are merged in one
pass (DCP searches a ChainMap of one per rank, rank by rank, for each name).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from contextlib import contextmanager

from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ..torch_internals import validate_global_plan
from .rectangles import tiles


def global_save_plan(
    all_plans: list[SavePlan], dedup: Callable[[list[SavePlan]], list[SavePlan]]
) -> tuple[list[SavePlan], Metadata]:
    """The global plan and metadata of every rank's `all_plans` (`dedup`: the planner's removal
    of duplicates). Python's cycle collector is paused while it runs: each item is copied a
    few times, and those copies set off full collections that walk every rank's plan again,
    which doubled the time at 4,096 ranks; what it leaves is collected after."""
    with _collector_paused():
        global_plan, metadata = create_default_global_save_plan(dedup(all_plans))
        nesting: dict = {}
        for plan in reversed(global_plan):  # the lowest rank's wins, as in DCP's ChainMap
            nesting.update(plan.planner_data or {})
        metadata = dataclasses.replace(metadata, planner_data=nesting)
        entries = metadata.state_dict_metadata.items()
        untiled = [name for name, entry in entries if not _tiled(entry)]
        if untiled:
            errors = validate_global_plan(global_plan, metadata, untiled)
            if errors:
                summary = "; ".join(errors)
                summary = summary if len(summary) <= 500 else summary[:500] + "... (truncated)"
                raise ValueError(f"Failed to validate global plan: {summary}")
    return global_plan, metadata


@contextmanager
def _collector_paused():
    """No cyclic garbage collection inside (reference counting still frees); restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _tiled(entry) -> bool:
    """Whether a stored entry needs no further check: not a tensor's boxes, a 0-d tensor, or
    boxes that tile its tensor ([Note: tiling check] in rectangles.py)."""
    chunks = getattr(entry, "chunks", None)
    if chunks is None or len(entry.size) == 0:
        return True
    return tiles(entry.size, [(c.offsets, c.sizes) for c in chunks])

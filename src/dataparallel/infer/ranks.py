"""What the ranks of `generate` and `eval` exchange: shares of the work, and a few numbers.

Each exchange is watched by the watchdog ([Note: collective progress] in comm/progress.py),
so a rank that stalls is named, as in training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dataparallel as dp

from ..comm.plain import all_gather_plain
from ..comm.progress import watched


def contiguous_share(count: int, world: dp.World) -> range:
    """This rank's part of range(count): consecutive items, shares differing by one at most."""
    return range(
        world.rank * count // world.world_size, (world.rank + 1) * count // world.world_size
    )


def strided_share(count: int, world: dp.World) -> range:
    """This rank's part of range(count): items rank, rank + world_size, ..."""
    return range(world.rank, count, world.world_size)


def reduce_numbers(values: list[float], world: dp.World, op: str = "sum", what: str = "") -> list:
    """The sum (or max) of a few numbers over the ranks, in float64 (counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)
    if world.world_size > 1:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        with watched(world.group, "all_reduce", tensor, what=what):
            dist.all_reduce(tensor, op=reduce_op, group=world.group)
    return tensor.tolist()


def gather_objects(value, world: dp.World, what: str = "") -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if world.world_size == 1:
        return [value]
    with watched(world.group, "all_gather_object", what=what):  # never a pickle
        return all_gather_plain(value, group=world.group)

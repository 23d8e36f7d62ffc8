"""The narrow handle on a parallelized model: what features outside the strategies may touch.

[Note: the handle] `parallelize` attaches a whole `Strategy` to the model (24 methods: the
reducer, the optimizers it built, its buckets, ...). The features built on top (checkpoints,
live recovery, the EMA) need only a few of them, and reaching past those into a strategy's
internals ties every feature to every strategy's insides. So they get this handle, after
FSDP2's `FSDPModule`, whose face is a handful of verbs (`unshard`, `reshard`,
`set_requires_gradient_sync`) over whatever the sharding holds:

- `name`, `geometry()`: which strategy, and what this rank holds ([Note: geometry]);
- `finish_param_gather()`, `refresh()`: make the parameters whole to read, or follow the
  optimizer's tensors after code wrote them outside `step()`;
- `no_sync()`, `rebind(group)`: accumulate without communication; train over another group;
- `replica_group`, `comms()`, `stateful_hook()`: the group across replicas of this rank's
  shard, the communicators to count or abandon, and the reduction hook's own state to save.

`dataparallel.handle_of(model)` returns it. The strategy itself stays inside the package
(`api.strategy_of`, for the public calls and the tests of the strategies' insides).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist

from ..comm import Comm
from .base import Strategy
from .parts.geometry import Geometry

__all__ = ["Handle"]


class Handle:
    """The face of a parallelized model's strategy ([Note: the handle])."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: Strategy):
        self._strategy = strategy

    @property
    def name(self) -> str:
        """The strategy's name ("ddp", "zero1", "zero2", "zero3")."""
        return self._strategy.name

    def geometry(self) -> Geometry:
        """What this rank holds of each parameter ([Note: geometry] in parts/geometry.py)."""
        return self._strategy.geometry()

    def finish_param_gather(self) -> None:
        """Wait for a parameter all-gather in flight (ZeRO-1/2's overlap); no-op otherwise."""
        self._strategy.finish_param_gather()

    def refresh(self) -> None:
        """Make the model's parameters follow the optimizer's tensors after code wrote them
        outside `step()`: ZeRO-1/2 all-gather (collective over the shard group)."""
        self._strategy.refresh_params()

    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally, with no communication."""
        return self._strategy.no_sync()

    def rebind(self, group) -> None:
        """Train over `group` from now on (`dataparallel.rebind`)."""
        self._strategy.rebind(group)

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold what this rank holds, one per replica: the replicate group of a
        2-D mesh (HSDP, DDP with fp32 masters); None on a 1-D layout (plain DDP, ZeRO over
        every rank)."""
        groups = self._strategy.groups
        replicate = None if groups is None else groups.replicate
        return None if replicate is None else replicate.group

    def comms(self) -> list[Comm]:
        """The communicators the strategy talks through (each once)."""
        return self._strategy.comms()

    def stateful_hook(self):
        """The reduction hook whose state a checkpoint keeps (compression), else None."""
        return self._strategy.stateful_hook()

"""Process groups split from a group keep its timeout.

    shard = subgroup([0, 1], parent=world_group)     # its collectives fail when the parent's do

[Note: inherited timeout] `dist.new_group` without `timeout=` gives the new group torch's
default (30 minutes for gloo), whatever the group it was split from waits. A live run
(`--recovery live`) has no watchdog and relies on the timeout of every group it talks through
to turn a stalled peer into an error (`--collective-timeout`, [Note: live recovery] in
train/live/recovery.py): an HSDP replica's rank blocked in a shard-group collective on a
sibling that had already failed waited 30 minutes instead of 10 s, its sibling gave it up as
hung ([Note: HSDP replicas]), and with both of a replica's ranks gone nothing was left to
heal from (tests/e2e/test_live_hsdp.py's scenario: 2 trials in about 30 hung). So every group
the engine splits from another (`init_mesh`'s shard and replicate groups, the checkpoint
group) is made with the timeout its parent's backend was made with, read from the backend's
options; a backend with none to read (the fake one of a dry run) gives torch's default.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..torch_internals import backend_timeout


def timeout_of(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """How long a collective of `group` (default: the world) waits before it fails, as its
    backend was made; None where the backend has no options to read (the fake backend)."""
    group = group if group is not None else dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        timeout = backend_timeout(group, device)
        if timeout is not None:
            return timeout
    return None


def subgroup(
    ranks: list[int] | None,
    parent: dist.ProcessGroup | None = None,
    *,
    local: bool = True,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """`dist.new_group(ranks)` with the timeout of `parent` (default: the world) ([Note:
    inherited timeout]). local: only the members synchronise (`use_local_synchronization`);
    False: every rank of the world calls it (as `new_group` of all ranks needs)."""
    return dist.new_group(
        ranks, timeout=timeout_of(parent), backend=backend, use_local_synchronization=local
    )

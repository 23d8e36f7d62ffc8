"""Groups split from another keep its timeout ([Note: inherited timeout] in comm/groups.py): a
shard-group collective whose peer never comes fails at the parent's timeout, not torch's 30
minutes (the live HSDP run that waited on a failed sibling until the sibling was given up)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dataparallel as dp
from dataparallel.comm.groups import timeout_of
from dataparallel.train.checkpointing import Checkpointer

from .harness import run_world

PARENT_S = 2.0


def shard_group_without_its_peer(world) -> dict:
    parent = dist.new_group([0, 1], timeout=timedelta(seconds=PARENT_S))
    mesh = dp.init_mesh(2, parent)  # one shard group of both ranks, a replicate group each
    out = {
        "timeouts": [timeout_of(g).total_seconds() for g in (mesh.shard_group, mesh.replicate_group)],
        "checkpoint": timeout_of(Checkpointer._new_group(world)).total_seconds(),
        "world": timeout_of(world.group).total_seconds(),
    }
    if world.rank == 0:  # rank 1 never joins this all-reduce
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed out|timeout"):
            dist.all_reduce(torch.ones(4), group=mesh.shard_group)
        out["failed_after_s"] = time.monotonic() - started
    dist.barrier()  # the world's group is untouched: rank 1 waited here for rank 0
    return out


def test_a_shard_group_collective_fails_at_its_parents_timeout():
    results = run_world(2, shard_group_without_its_peer, timeout=120)
    assert len(results) == 2
    for out in results:
        assert out["timeouts"] == [PARENT_S, PARENT_S]
        # the checkpoint group: the world's timeout (dp.init's 10 minutes), not torch's 30
        assert out["checkpoint"] == out["world"] == 600.0
    assert PARENT_S <= results[0]["failed_after_s"] < PARENT_S + 5, results[0]

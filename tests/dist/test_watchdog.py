"""The watchdog and the checked mode in a real 2-rank gloo world ([Note: watchdog],
[Note: checked collectives]); the SIGSTOP test of the whole command is tests/e2e/test_hang.py."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import dataparallel as dp
from dataparallel.comm import CollectiveMismatch, Comm, Watchdog, watched
from dataparallel.comm.progress import PROGRESS

from .harness import run_world


def mismatches(world) -> dict:
    dp.init(check_collectives=True)  # the API switch; init again returns the same world
    rank = world.rank
    comm = Comm(pairwise=True)
    out: dict = {"errors": []}
    # Matching collectives pass the check and still compute the right thing.
    x = torch.full((4096,), float(rank + 1))
    comm.all_reduce(x)
    mine = torch.empty(2048)
    comm.reduce_scatter(mine, torch.arange(4096.0), async_op=True).wait()
    gathered = torch.empty(8)
    comm.all_gather(gathered, torch.full((4,), float(rank)))
    out["sums"] = (x[0].item(), mine[0].item(), gathered.tolist())

    def attempt(call):
        try:
            call()
            out["errors"].append(None)
        except CollectiveMismatch as error:
            out["errors"].append(str(error))

    # Rank 1 calls another kind, then another shape, then (through `watched`) another dtype.
    grad = torch.zeros(4096)
    if rank == 0:
        attempt(lambda: comm.all_reduce(grad))
    else:
        attempt(lambda: comm.all_gather(torch.zeros(8192), grad))
    attempt(lambda: comm.all_reduce(torch.zeros(4096 - rank)))
    sums = torch.zeros(2, dtype=torch.float64 if rank == 0 else torch.float32)

    def trainer_style():
        with watched(world.group, "all_reduce", sums, what="trainer sums"):
            dist.all_reduce(sums, group=world.group)

    attempt(trainer_style)
    # The world is still in step after the refused collectives.
    y = torch.ones(3)
    comm.all_reduce(y)
    out["after"] = y.tolist()
    out["launched"] = PROGRESS.launched[comm.group_name]
    return out


def test_the_checked_mode_names_the_rank_and_what_differs():
    results = run_world(2, mismatches)
    gathered = [0.0] * 4 + [1.0] * 4
    assert [r["sums"] for r in results] == [(3.0, 0.0, gathered), (3.0, 4096.0, gathered)]
    assert results[0]["errors"] == results[1]["errors"]  # every rank, the same line
    kind, shape, dtype = results[0]["errors"]
    tail = (
        "; every rank of a group must call the same collectives, with tensors of the same "
        "shape and dtype, in the same order"
    )
    # #1-#3 were the matching collectives above.
    assert kind == (
        "collective mismatch: collective #4 on group of 2 (ranks 0-1): rank 1 called "
        "all_gather [4096] float32 while rank 0 called all_reduce sum [4096] float32" + tail
    )
    assert shape == (
        "collective mismatch: collective #5 on group of 2 (ranks 0-1): rank 1 called "
        "all_reduce [4095] float32 while rank 0 called all_reduce [4096] float32" + tail
    )
    assert dtype == (
        "collective mismatch: collective #6 on group of 2 (ranks 0-1): rank 1 called "
        "all_reduce [2] float32 while rank 0 called all_reduce [2] float64" + tail
    )
    assert results[0]["after"] == [2.0] * 3
    assert results[0]["launched"] == results[1]["launched"] == 7


def late_rank(world) -> dict:
    lines: list[str] = []
    dog = Watchdog(
        dist.distributed_c10d._get_default_store(),
        world.rank,
        world.world_size,
        timeout_s=1.0,
        interval_s=0.1,
        prefix="test-watchdog",
        report=lines.append,  # record instead of ending the process
    ).start()
    comm = Comm()
    comm.all_reduce(torch.ones(1))  # #1, together
    started = time.monotonic()
    if world.rank == 1:
        time.sleep(3.0)  # alive (its watchdog beats) but late for #2
    with comm.tracer.labelled(bucket=3):
        work = comm.all_reduce(torch.ones(1), async_op=True)  # waited below: a wait, too
    work.wait()
    waited = time.monotonic() - started
    fired_after = None
    dog.stop()
    if lines:
        fired_after = float(re.search(r"waited (\d+\.\d) s", lines[0]).group(1))
    return {"lines": lines, "waited": waited, "fired_after": fired_after}


def test_a_late_rank_is_named_while_it_is_still_late():
    rank0, rank1 = run_world(2, late_rank)
    assert rank1["lines"] == []  # it was never waiting long
    (line,) = rank0["lines"]
    assert line.startswith(
        "collective timeout: rank 1 never arrived at all_reduce #2 (bucket 3) on ranks 0-1: "
        "rank 0 waited "
    )
    assert "(rank 1 is at #1, alive, not in a collective)" in line
    # at the timeout, 1.0 s, + up to one 0.1 s tick (+ slack for a loaded machine)
    assert 1.0 <= rank0["fired_after"] <= 1.4, line
    assert rank0["waited"] >= 2.5  # and the collective then completed: nothing was killed


def test_init_checks_the_timeout_and_still_sets_the_threads():
    import dataparallel as dp

    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match=r"collective_timeout=-1 must be >= 0 \(0: off\)"):
            dp.init(collective_timeout=-1)
        world = dp.init(threads=2, collective_timeout=5, check_collectives=True)
        assert torch.get_num_threads() == 2
        assert world.world_size == 1  # alone: no watchdog to start, nothing to check against
        from dataparallel import runtime
        from dataparallel.comm.progress import PROGRESS

        assert runtime._watchdog is None and PROGRESS.check
        dp.destroy()
        assert not PROGRESS.check and PROGRESS.launched == {}
    finally:
        torch.set_num_threads(before)
        dp.destroy()

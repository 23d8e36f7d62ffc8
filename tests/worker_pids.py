"""The worker processes of a launcher, read from /proc (Linux): for the tests and the trials
(benchmarks/) that stop or kill one worker of a running `dataparallel train`."""

from __future__ import annotations

import json
from pathlib import Path


def children(pid: int, deep: bool = True) -> list[int]:
    """The children of `pid`, and with `deep` every descendant (children first); [] once it is
    gone."""
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return direct + [g for c in direct for g in children(c)] if deep else direct


def environment(pid: int, name: str) -> str | None:
    """The value of `name` in the process's environment (None: unset, or the process gone)."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((e[len(prefix) :].decode() for e in entries if e.startswith(prefix)), None)


def process_name(pid: int) -> str | None:
    """The process's name (/proc/PID/comm; None once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def rank_of(pid: int) -> str | None:
    """A worker's RANK: its name where it was forked from the launcher ("dp rank N": [Note:
    forked workers] in launch/forked.py), else its environment (a fresh interpreter's)."""
    name = process_name(pid)
    if name is None:
        return None
    if name.startswith("dp rank "):
        return name.removeprefix("dp rank ")
    return environment(pid, "RANK")


def workers_by_rank(launcher: int) -> dict[int, int]:
    """{RANK: pid} of the workers below the launcher process `launcher` (torchrun's agent)."""
    ranks = {rank_of(p): p for p in children(launcher)}
    return {int(rank): pid for rank, pid in ranks.items() if rank is not None}


def live_slot(pid: int) -> tuple[int, int] | None:
    """(slot, index) of a `--recovery live` worker: its name where it was forked from the
    launcher ("dp slot R.I": [Note: forked workers] in launch/forked.py), else its
    DATAPARALLEL_LIVE (a fresh interpreter's environment); None for any other process."""
    name = process_name(pid)
    if name is None:
        return None
    if name.startswith("dp slot "):
        replica, index = name.removeprefix("dp slot ").split(".")
        return int(replica), int(index)
    live = environment(pid, "DATAPARALLEL_LIVE")
    if live is None:
        return None
    given = json.loads(live)
    return given["replica"], given.get("index", 0)


def live_workers(launcher: int) -> dict[int, int]:
    """{slot: pid} of a `--recovery live` launcher's workers (an HSDP replica: its first
    process; the workers' own children are not counted)."""
    ranks = live_ranks(launcher)
    return {slot: pid for (slot, index), pid in ranks.items() if index == 0}


def live_ranks(launcher: int) -> dict[tuple[int, int], int]:
    """{(slot, index): pid} of a `--recovery live` launcher's workers: under --shard-group S a
    slot (one replica) has S processes, index 0..S-1."""
    found = {}
    for pid in children(launcher, deep=False):
        where = live_slot(pid)
        if where is not None:
            found[where] = pid
    return found

"""The watchdog's and the checked mode's logic, without a process group: sequence numbers and
waits, who is behind, and the one-line messages ([Note: watchdog], [Note: checked collectives])."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.distributed import ReduceOp

from dataparallel.comm.progress import (
    FINGERPRINT,
    Collective,
    Progress,
    fingerprint,
    label_text,
    mismatch_message,
    ranks_text,
)
from dataparallel.comm.watchdog import Straggler, Watchdog, find_stragglers, hang_message


def test_progress_numbers_collectives_per_group_and_lists_waits():
    progress = Progress()
    first = progress.launch("0", "all_reduce", {})
    second = progress.launch("0", "broadcast", {"bucket": 3})
    other = progress.launch("7", "all_gather", {})
    assert (first.seq, second.seq, other.seq) == (1, 2, 1)
    assert progress.launched == {"0": 2, "7": 1}
    assert progress.oldest_wait() is None
    a = progress.begin_wait(second)
    time.sleep(0.01)
    b = progress.begin_wait(other)
    collective, since = progress.oldest_wait()
    assert collective is second and since < progress.waiting[b][1]
    progress.end_wait(a)
    assert progress.oldest_wait()[0] is other
    progress.end_wait(b)
    progress.end_wait(b)  # twice is harmless
    assert progress.oldest_wait() is None and progress.waiting == {}


def test_ranks_and_labels_read_short():
    assert ranks_text([0, 1]) == "0-1"
    assert ranks_text([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9"
    assert ranks_text([5]) == "5"
    assert label_text({"bucket": 3}) == "bucket 3"
    assert label_text({"unit": 2}) == "unit 2"
    assert label_text({"what": "gradient norm"}) == "gradient norm"
    assert label_text({}) == ""


def _record(beat: int, launched: dict, waiting: str | None = None) -> dict:
    return {"beat": beat, "launched": launched, "waiting": waiting}


def test_stragglers_are_the_ranks_behind_or_silent():
    stuck = Collective("0", 57, "all_reduce", {"bucket": 3})
    members = (0, 1, 2, 3)
    before = {
        0: _record(10, {"0": 57}),
        1: _record(10, {"0": 56}),  # behind, and its heartbeat stops: SIGSTOP
        2: _record(10, {"0": 57}),  # arrived, alive
        3: _record(10, {"0": 55, "4": 3}, "broadcast #3 on ranks 1,3"),  # behind, alive
    }
    after = {
        0: _record(13, {"0": 57}),
        1: _record(10, {"0": 56}),
        2: _record(13, {"0": 58}),
        3: _record(13, {"0": 55, "4": 3}, "broadcast #3 on ranks 1,3"),
    }
    got = find_stragglers(stuck, members, 0, before, after)
    assert got == [
        Straggler(1, 56, alive=False),
        Straggler(3, 55, alive=True, waiting="broadcast #3 on ranks 1,3"),
    ]
    # A rank that never published, and one that reached the collective but went silent in it.
    after[2] = None
    before[2] = None
    after[3] = _record(10, {"0": 57})
    before[3] = _record(10, {"0": 57})
    got = find_stragglers(stuck, members, 0, before, after)
    assert got == [
        Straggler(1, 56, alive=False),
        Straggler(2, None, alive=False),
        Straggler(3, 57, alive=False),
    ]


def test_the_hang_message_names_the_missing_rank_and_the_collective():
    stuck = Collective("0", 57, "all_reduce", {"bucket": 3})
    line = hang_message(stuck, (0, 1), 0, 5.04, [Straggler(1, 56, alive=False)])
    assert line == (
        "collective timeout: rank 1 never arrived at all_reduce #57 (bucket 3) on ranks 0-1: "
        "rank 0 waited 5.0 s (rank 1 is not responding, last reported at #56); find what "
        "stalled rank 1, "
        "or raise --collective-timeout (0 turns the watchdog off) if it is only slow"
    )
    assert "\n" not in line
    busy = Straggler(3, 55, alive=True, waiting="broadcast #3 on ranks 1,3")
    line = hang_message(stuck, (0, 1, 2, 3), 2, 300.0, [Straggler(1, None, False), busy])
    assert line.startswith(
        "collective timeout: rank 1, rank 3 never arrived at all_reduce #57 (bucket 3) on "
        "ranks 0-3: rank 2 waited 300.0 s (rank 1 published no progress; rank 3 is at #55, "
        "alive, waiting on broadcast #3 on ranks 1,3); "
    )
    # Rank 1 stopped inside the collective (its part not sent): named all the same.
    line = hang_message(stuck, (0, 1), 0, 5.0, [Straggler(1, 57, alive=False)])
    assert line.startswith(
        "collective timeout: rank 1 stopped responding inside all_reduce #57 (bucket 3) on "
        "ranks 0-1: rank 0 waited 5.0 s (rank 1 is not responding, last reported at #57); "
        "find what stalled rank 1, "
    )
    # Everyone arrived and beats: the ranks may disagree on what they called.
    line = hang_message(stuck, (0, 1), 0, 5.0, [])
    assert line == (
        "collective timeout: all_reduce #57 (bucket 3) on ranks 0-1 has not completed after "
        "5.0 s on rank 0, though every rank reached it; rerun with --check-collectives to see "
        "whether the ranks called the same collectives, or raise --collective-timeout (0 turns "
        "the watchdog off) if it is only slow"
    )


def test_fingerprints_and_the_mismatch_message():
    c = Collective("0", 57, "all_reduce", {})
    grad = torch.zeros(4096)
    ours = fingerprint(c, grad, ReduceOp.SUM)
    assert len(ours) == FINGERPRINT
    assert ours[:6] == [0, 57, 0, 0, 1, 4096] and ours[13] == 4096
    gather = fingerprint(Collective("0", 57, "all_gather", {}), grad)
    assert mismatch_message(57, (0, 1), [ours, ours]) is None
    assert mismatch_message(57, (0, 1), [ours, gather]) == (
        "collective mismatch: collective #57 on group of 2 (ranks 0-1): rank 1 called "
        "all_gather [4096] float32 while rank 0 called all_reduce sum [4096] float32; "
        "every rank of a group must call the same collectives, with tensors of the same shape "
        "and dtype, in the same order"
    )
    # Shape, dtype and op: only what differs beyond kind/shape/dtype is spelled out.
    wide = fingerprint(c, torch.zeros(2, 2048, dtype=torch.bfloat16), ReduceOp.SUM)
    assert "rank 3 called all_reduce [2, 2048] bfloat16 while rank 0 called all_reduce [4096] " in (
        mismatch_message(57, (0, 2, 3), [ours, ours, wide])
    )
    maxed = fingerprint(c, grad, ReduceOp.MAX)
    assert "rank 1 called all_reduce max [4096] float32 while rank 0 called all_reduce sum" in (
        mismatch_message(57, (0, 1), [ours, maxed])
    )
    big = fingerprint(c, torch.zeros([1] * 10))
    assert "[1, 1, 1, 1, 1, 1, 1, 1, ... (1 elements)]" in mismatch_message(57, (0, 1), [ours, big])


class _Store:
    """A dict behind the Store calls the watchdog makes (no clone: used as is)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def compare_set(self, key, expected, desired):  # torch's: "" expects no key
        current = self.data.get(key, b"")
        if current == expected.encode():
            self.data[key] = desired.encode()
        return self.data.get(key, current)


def test_the_watchdog_fires_after_the_timeout_naming_the_silent_rank():
    store, progress, lines = _Store(), Progress(), []
    progress.members["0"] = (0, 1)
    dog = Watchdog(store, 0, 2, 0.3, interval_s=0.05, progress=progress, report=lines.append)
    # Rank 1 published once, at #4, and then nothing: stopped.
    store.set("dataparallel/watchdog/1", '{"beat": 1, "launched": {"0": 4}, "waiting": null}')
    for _ in range(5):
        collective = progress.launch("0", "all_reduce", {"unit": 2})
    started = time.monotonic()
    token = progress.begin_wait(collective)
    dog.start()
    try:
        while not lines and time.monotonic() - started < 5:
            time.sleep(0.01)
    finally:
        dog.stop()
        progress.end_wait(token)
    latency = time.monotonic() - started
    # The first look at the others 3 intervals before the timeout, the verdict at the timeout
    # (plus up to one interval to notice; plus slack for a loaded machine).
    assert 0.3 <= latency < 0.3 + 0.05 + 0.3, latency
    assert lines == [dog.fired]
    assert re.match(
        r"collective timeout: rank 1 never arrived at all_reduce #5 \(unit 2\) on ranks 0-1: "
        r"rank 0 waited 0\.[3-6] s \(rank 1 is not responding, last reported at #4\); ",
        lines[0],
    ), lines[0]
    record = store.data["dataparallel/watchdog/0"]
    assert b'"launched": {"0": 5}' in record and b"all_reduce #5 (unit 2) on ranks 0-1" in record


def test_no_wait_no_fire_and_a_bad_timeout_is_refused():
    store, progress, lines = _Store(), Progress(), []
    dog = Watchdog(store, 0, 2, 0.1, interval_s=0.02, progress=progress, report=lines.append)
    progress.launch("0", "all_reduce", {})  # launched, never waited on
    dog.start()
    time.sleep(0.3)
    dog.stop()
    assert lines == [] and dog.beat >= 5
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        Watchdog(store, 0, 2, 0)


def test_only_the_lowest_live_rank_reports_at_once():
    """Ranks 0 and 1 wait on #3 of a group of 3 whose rank 2 stopped at #2: rank 0 reports at
    the timeout, rank 1 only `report_grace_s` later (by when the launcher has normally ended
    it), so that the run prints one line ([Note: watchdog exit])."""
    store = _Store()
    store.set("dataparallel/watchdog/2", '{"beat": 1, "launched": {"0": 2}, "waiting": null}')
    fired: dict[int, float] = {}
    dogs, tokens = [], []
    started = time.monotonic()
    for rank in (0, 1):
        progress = Progress()
        progress.members["0"] = (0, 1, 2)
        for _ in range(3):
            collective = progress.launch("0", "broadcast", {})
        tokens.append((progress, progress.begin_wait(collective)))

        def report(line, rank=rank):
            fired[rank] = time.monotonic() - started

        dog = Watchdog(store, rank, 3, 0.3, interval_s=0.05, progress=progress, report=report)
        dogs.append(dog.start())
    try:
        _wait(lambda: len(fired) == 2, 5)
    finally:
        for dog in dogs:
            dog.stop()
    assert dogs[0].report_grace_s == pytest.approx(0.3)
    assert 0.3 <= fired[0] < 0.6, fired
    assert fired[1] - fired[0] >= 0.3 - 0.05, fired
    assert dogs[0].fired.startswith(
        "collective timeout: rank 2 never arrived at broadcast #3 on ranks 0-2: rank 0 "
    )
    # Rank 1, not ended by a launcher here, points at rank 0's line rather than repeating it.
    assert dogs[1].fired == (
        "watchdog: rank 1 ends too, its collective left waiting by rank 0's collective timeout "
        "above"
    )


def test_a_rank_firing_after_another_reported_points_at_it():
    """A stopped rank continued by the launcher fires on the rank that already reported and
    ended: one verdict per attempt, in a real torch Store ([Note: watchdog exit])."""
    store = torch.distributed.HashStore()
    dogs = [Watchdog(store, rank, 2, 1.0, prefix="w/0") for rank in (0, 1)]
    assert dogs[0].claim("collective timeout: rank 1 never arrived") == (
        "collective timeout: rank 1 never arrived"
    )
    assert dogs[0].claim("again") == "again"  # its own claim stands
    assert dogs[1].claim("collective timeout: rank 0 stopped responding") == (
        "watchdog: rank 1 ends too, its collective left waiting by rank 0's collective timeout "
        "above"
    )
    # A restarted attempt (another prefix) starts with no report.
    fresh = Watchdog(store, 1, 2, 1.0, prefix="w/1")
    assert fresh.claim("collective timeout: x") == "collective timeout: x"


def _wait(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_process_paused_counts_its_waits_from_its_return():
    """[Note: a paused watcher]: a wait already past the timeout when the process comes back
    from a pause (a SIGSTOP, continued) is not reported at once, but a timeout after the return;
    the same wait without a pause is reported at the first look."""
    latencies = {}
    for paused in (False, True):  # 2 cases
        store, progress, lines = _Store(), Progress(), []
        progress.members["0"] = (0, 1)
        store.set("dataparallel/watchdog/1", '{"beat": 1, "launched": {"0": 0}, "waiting": null}')
        token = progress.begin_wait(progress.launch("0", "all_reduce", {}))
        dog = Watchdog(store, 0, 2, 0.3, interval_s=0.05, progress=progress, report=lines.append)
        time.sleep(0.4)  # the wait is past the timeout
        if paused:  # two ticks 10 s apart: the process did not run in between
            now = time.monotonic()
            dog.tick(now - 10.0)
            dog.tick(now)
            assert dog.resumed_at == now
        back = time.monotonic()
        dog.start()
        try:
            _wait(lambda lines=lines: lines, 5)
        finally:
            dog.stop()
            progress.end_wait(token)
        assert len(lines) == 1, lines
        latencies[paused] = time.monotonic() - back
    assert latencies[False] < 0.25, latencies  # at once: two looks an interval or two apart
    assert 0.3 <= latencies[True] < 0.3 + 0.4, latencies  # a timeout after the return

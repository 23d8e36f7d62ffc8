"""A watchdog that turns a hung collective into one error line naming the rank that is missing.

    watchdog = Watchdog(store, rank, world_size, timeout_s=300)   # dp.init does this
    watchdog.start()
    ...                                                            # train
    watchdog.stop()

[Note: watchdog] A thread per process. Every `interval_s` it publishes this rank's progress
([Note: collective progress] in progress.py: collectives launched per group, and the one the
training thread waits on) to the rendezvous store under `prefix/<rank>`, with a heartbeat count.
When a wait nears `timeout_s`, it reads the progress of every rank of that collective's group,
and again at the timeout; it names as missing the ranks whose count on the group is below the
collective's number (they never arrived) and says which of them still beat (alive, busy or
waiting elsewhere) and which do not (stopped, or frozen in the kernel). The training
thread never touches the store: its cost per collective is that of `Progress` (one dict update
and a clock read), and the thread's is one small store write per `interval_s`.

[Note: watchdog exit] The training thread is blocked inside the backend when the watchdog fires,
so no exception can reach it; the watchdog prints its line to stderr, flushes, and ends the
process with `os._exit(1)`, without unwinding. The launcher (torchrun's agent) then stops the
other workers. Every rank of the group that is still alive fires about together; so that the
run prints one line rather than one per rank, the lowest-numbered live rank reports at once and
the others wait `report_grace_s` first (normally ending, stopped by the launcher, before they
print; if not, they print theirs). A rank that fires after another's report is in the store
(`prefix/reported`) ends with a short line pointing at it instead of a second verdict: a worker
stopped inside a collective and continued by the launcher to take its SIGTERM cannot run its
handler (the training thread is in the backend), so its watchdog fires on the rank that has
already reported and ended ("rank 0 stopped responding"), a false second line beside the true
one (tests/e2e/test_hang.py, once in a full suite).

[Note: a paused watcher] A process stopped (SIGSTOP) and continued, or starved of the CPU for
seconds, comes back to a wait that looks old by the time it did not run; its watchdog would
blame the others for it (a stopped rank, continued by the launcher only to take its SIGTERM,
printed "rank 0 stopped responding ... rank 1 waited 6.2 s" before it ended: a second, false
line beside the true one, tests/e2e/test_hang.py under load). So the watchdog counts a wait
only from the end of its own last pause: a tick later than `interval_s` + PAUSE_S means the
process did not run in between. A starved process reports later by as long as it starved.

The store: a clone of the process group's store, with its own connection and a short timeout,
so that a rank hosting the store that is stopped cannot hold the watchdog for the process
group's long one (under torchrun the agent hosts it, and nothing stalls).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .progress import PROGRESS, Collective, Progress, label_text, ranks_text

PAUSE_S = 2.0  # a tick this much later than due: the process did not run ([Note: a paused watcher])


@dataclass(frozen=True)
class Straggler:
    """A rank of the group that did not arrive, or whose heartbeat stopped.

    rank: its global rank.
    reached: its count of collectives on the group (it launched #1..#reached); None when it
        published no progress at all.
    alive: whether its heartbeat moved while the watchdog looked.
    waiting: what it waits on, as text ("broadcast #3 on ranks 1,3"), or "" when nothing.
    """

    rank: int
    reached: int | None
    alive: bool
    waiting: str = ""


def published(progress: Progress, beat: int) -> dict:
    """This rank's record in the store: heartbeat, counts, and its oldest wait."""
    record: dict = {"beat": beat, "launched": dict(progress.launched), "waiting": None}
    oldest = progress.oldest_wait()
    if oldest is not None:
        collective = oldest[0]
        members = progress.members.get(collective.group, ())
        record["waiting"] = _collective_text(collective, members)
    return record


def find_stragglers(
    collective: Collective,
    members: tuple[int, ...],
    me: int,
    before: dict[int, dict | None],
    after: dict[int, dict | None],
) -> list[Straggler]:
    """The ranks of `members` (but `me`) that have not reached `collective` in `after`, or whose
    heartbeat did not move from `before` to `after` (records as `published` writes them; None
    when a rank has published nothing)."""
    stragglers = []
    for rank in members:
        if rank == me:
            continue
        old, new = before.get(rank), after.get(rank)
        if new is None:
            stragglers.append(Straggler(rank, None, alive=False))
            continue
        reached = new["launched"].get(collective.group, 0)
        alive = old is not None and new["beat"] != old["beat"]
        if reached < collective.seq or not alive:
            stragglers.append(Straggler(rank, reached, alive, new.get("waiting") or ""))
    return stragglers


def hang_message(
    collective: Collective,
    members: tuple[int, ...],
    me: int,
    waited_s: float,
    stragglers: list[Straggler],
) -> str:
    """The one line the watchdog prints ([Note: watchdog]): first the ranks that never arrived
    or, failing those, the ranks that stopped responding inside the collective."""
    what = _collective_text(collective, members)
    slow = "raise --collective-timeout (0 turns the watchdog off) if it is only slow"
    missing = [s for s in stragglers if s.reached is None or s.reached < collective.seq]
    frozen = [s for s in stragglers if s not in missing and not s.alive]
    states = f" ({'; '.join(_straggler_text(s) for s in stragglers)})" if stragglers else ""
    if missing or frozen:
        names = ", ".join(f"rank {s.rank}" for s in missing or frozen)
        how = "never arrived at" if missing else "stopped responding inside"
        head = f"{names} {how} {what}: rank {me} waited {waited_s:.1f} s{states}"
        return f"collective timeout: {head}; find what stalled {names}, or {slow}"
    return (
        f"collective timeout: {what} has not completed after {waited_s:.1f} s on rank {me}, "
        "though every rank reached it; rerun with --check-collectives to see whether the ranks "
        f"called the same collectives, or {slow}"
    )


def _straggler_text(s: Straggler) -> str:
    if s.reached is None:
        return f"rank {s.rank} published no progress"
    if not s.alive:  # its last record may be up to one interval old
        return f"rank {s.rank} is not responding, last reported at #{s.reached}"
    state = f"waiting on {s.waiting}" if s.waiting else "not in a collective"
    return f"rank {s.rank} is at #{s.reached}, alive, {state}"


def _collective_text(collective: Collective, members: tuple[int, ...]) -> str:
    label = label_text(collective.label)
    label = f" ({label})" if label else ""
    group = f"ranks {ranks_text(members)}" if members else f"group {collective.group}"
    return f"{collective.kind} #{collective.seq}{label} on {group}"


def _report(message: str) -> None:
    """Print and end the process ([Note: watchdog exit])."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """Ends a process whose collective has waited `timeout_s`, with one line naming the missing
    ranks ([Note: watchdog]).

    store: a torch.distributed Store every rank reaches (the process group's); the watchdog
        clones it when it can ([Note: watchdog], the store).
    rank, world_size: this process' global rank and the world size.
    timeout_s: seconds a collective may wait before the run stops.
    interval_s: seconds between two publications of progress (and checks of the wait).
    prefix: where in the store the ranks publish (one key per rank under it).
    progress: the collectives to watch (the process's `PROGRESS`).
    report: called with the line; the default prints it and ends the process.
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        interval_s: float = 0.5,
        prefix: str = "dataparallel/watchdog",
        progress: Progress = PROGRESS,
        report=_report,
    ):
        if timeout_s <= 0:
            raise ValueError(f"Watchdog: timeout_s={timeout_s} must be > 0")
        self.store = _own_connection(store, timeout_s=max(2.0, 4 * interval_s))
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.prefix, self.progress, self.report = prefix, progress, report
        self.report_grace_s = 6 * interval_s
        self.beat = 0
        self.fired: str | None = None  # the line, once reported
        self._first_look: tuple | None = None  # (collective, when, records) of a long wait
        self._last_tick: float | None = None
        self.resumed_at = float("-inf")  # the end of this process's last pause
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self.publish()  # at once, so that a rank stalled early is not "published no progress"
        self._thread = threading.Thread(target=self._loop, name="dataparallel-watchdog")
        self._thread.daemon = True  # never keeps a finished process alive
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 1)
        self._thread = None

    def _loop(self) -> None:
        self._last_tick = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.tick(time.monotonic())
            self.publish()
            message = self.check()
            if message is not None and not self._stop.is_set():
                self.fired = self.claim(message)
                self.report(self.fired)
                return

    def claim(self, message: str) -> str:
        """`message`, published as the run's report; or, when another rank reported first, the
        short line that points at it ([Note: watchdog exit])."""
        key = f"{self.prefix}/reported"
        try:
            first = self.store.compare_set(key, "", str(self.rank))
        except (RuntimeError, dist.DistStoreError):
            return message  # the store is gone: say what this rank sees
        first = first.decode() if isinstance(first, bytes) else str(first)
        if first in ("", str(self.rank)):
            return message
        return (
            f"watchdog: rank {self.rank} ends too, its collective left waiting by rank {first}'s "
            "collective timeout above"
        )

    def tick(self, now: float) -> None:
        """Note the time of a tick; one much later than due ends a pause of this process: its
        waits count from now ([Note: a paused watcher])."""
        if self._last_tick is not None and now - self._last_tick > self.interval_s + PAUSE_S:
            self.resumed_at, self._first_look = now, None
        self._last_tick = now

    def publish(self) -> None:
        self.beat += 1
        record = json.dumps(published(self.progress, self.beat))
        try:
            self.store.set(f"{self.prefix}/{self.rank}", record)
        except (RuntimeError, dist.DistStoreError):
            pass  # the store is unreachable now: try at the next beat

    def check(self) -> str | None:
        """The line to report if a wait has lasted `timeout_s`; else None.

        The others' progress is read twice, the first time `3 x interval_s` before the timeout
        (or at least `2 x interval_s` before the second read), so that the verdict, who still
        beats, is ready at the timeout itself."""
        oldest = self.progress.oldest_wait()
        now = time.monotonic()
        # A wait counts from its start, or from the end of this process's last pause.
        since = max(oldest[1], self.resumed_at) if oldest is not None else now
        if oldest is None or now - since < self.timeout_s - 3 * self.interval_s:
            self._first_look = None
            return None
        collective = oldest[0]
        members = self.progress.members.get(collective.group, tuple(range(self.world_size)))
        if self._first_look is None or self._first_look[0] is not collective:
            self._first_look = (collective, now, self.read(members))
            return None
        _, first_at, before = self._first_look
        if now - since < self.timeout_s or now - first_at < 2 * self.interval_s:
            return None
        after = self.read(members)
        stragglers = find_stragglers(collective, members, self.rank, before, after)
        message = hang_message(collective, members, self.rank, now - since, stragglers)
        reporter = min([r for r in members if r not in {s.rank for s in stragglers}])
        if reporter != self.rank and self._stop.wait(self.report_grace_s):
            return None
        return message

    def read(self, ranks) -> dict[int, dict | None]:
        """The published records of `ranks` (None for one that published none, or unreadable)."""
        records: dict[int, dict | None] = {}
        for rank in ranks:
            key = f"{self.prefix}/{rank}"
            try:
                records[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except (RuntimeError, ValueError, dist.DistStoreError):
                records[rank] = None
        return records


def _own_connection(store, timeout_s: float):
    """A clone of `store` (its own connection) with a short timeout, or `store` itself when it
    cannot be cloned (a HashStore, in one process)."""
    try:
        clone = store.clone()
    except (AttributeError, RuntimeError):
        return store
    clone.set_timeout(timedelta(seconds=timeout_s))
    return clone

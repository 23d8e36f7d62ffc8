"""Continuing stopped workers that are being told to end, so that the launcher's grace is short.

[Note: stopped workers] When a worker fails (the watchdog's verdict on a stalled rank is one),
torchrun's agent sends the other workers SIGTERM and waits its shutdown timeout (30 s) before
SIGKILL. A worker stopped with SIGSTOP (or SIGTSTP) keeps the SIGTERM pending until it is
continued, so the agent waited the whole 30 s on it: with `--collective-timeout 20` the
watchdog named the stopped rank at 20 s and the command exited at 52 s. The agent's timeout
cannot simply be shortened: it is also the time a worker told to stop on Ctrl-C has to finish
the checkpoint it is writing.

So the launcher watches its own children: a worker that is stopped (state T in /proc) while a
termination signal (SIGTERM, SIGINT, SIGHUP or SIGQUIT: the ones torchrun passes on) is
pending gets SIGCONT, and takes the signal at once, as a running worker would. A worker merely
stopped (by an operator, with nothing pending) is left alone; one in uninterruptible sleep (D)
cannot be helped by any signal, and the agent's SIGKILL after its timeout stays the last resort.
It covers the end of a run and a restart alike (the agent stops the workers the same way
before starting new ones). Linux only (it reads /proc); elsewhere it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

# Bits of /proc/<pid>/status's SigPnd/ShdPnd: signal n is bit n - 1.
_ENDING = sum(1 << (s - 1) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT))


def child_pids() -> list[int]:
    """The direct children of this process (started by any of its threads)."""
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T: SIGSTOP, SIGTSTP, a debugger)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(
        line.startswith("State:") and line.split(":", 1)[1].strip().startswith("T")
        for line in status.splitlines()
    )


def stopped_with_ending_signal(pid: int) -> bool:
    """Whether process `pid` is stopped (T) with a termination signal pending."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if not fields.get("State", "").strip().startswith("T"):
        return False
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    return bool(pending & _ENDING)


class StoppedWorkers:
    """A thread that continues this process's stopped children once they are told to end
    ([Note: stopped workers]).

    period_s: how often the children are looked at; a stopped worker ends at most this long
        after the agent's SIGTERM.
    """

    def __init__(self, period_s: float = 0.2):
        self.period_s = period_s
        self.continued: list[int] = []  # the pids given SIGCONT, for tests and reports
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stopped-workers", daemon=True)

    def start(self) -> StoppedWorkers:
        if Path("/proc/self/task").is_dir():
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def check(self) -> None:
        """Continue every stopped child with a termination signal pending."""
        for pid in child_pids():
            if stopped_with_ending_signal(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    self.continued.append(pid)
                except ProcessLookupError:
                    pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.check()

"""The launcher's view of a live run's slots: what trains in each, and where it stands.

    worker = Worker(slot, process, Life.STARTING)       # a replacement or a joiner, just started
    worker.life = Life.MEMBER                           # let into a generation
    process = Replica([popen_0, popen_1])               # an HSDP replica's S children, as one

A slot's replica is watched through Popen's verbs (poll, send_signal, kill, wait) whatever it
is: one child process (subprocess.Popen, or a ForkedProcess: [Note: forked workers] in
launch/forked.py), the S children of an HSDP replica (`Replica`: they end
as one), or a joiner on any machine (`RemoteProcess` in remote.py, over the store).
"""

from __future__ import annotations

import enum
import signal
import subprocess
import time
from dataclasses import dataclass

from ...launch.forked import ForkedProcess
from ...launch.stopped_workers import is_stopped
from .remote import RemoteProcess


class Life(enum.Enum):
    """The state of the replica in a slot, as the launcher sees it."""

    STARTING = "starting"  # a replacement or a joiner, not yet let into a generation
    MEMBER = "member"  # in the current generation (or the first workers, before it)
    RELEASED = "released"  # a member let leave (`dataparallel leave`): goes at its next boundary
    ENDED = "ended"  # `ended_as` says what it was: after RELEASED, not replaced nor a failure


@dataclass
class Worker:
    """What trains in a slot: the launcher's child, its children of one HSDP replica
    (`Replica`), or a joiner (RemoteProcess)."""

    slot: int
    process: subprocess.Popen | ForkedProcess | Replica | RemoteProcess
    life: Life
    code: int | None = None
    ended_as: Life | None = None  # the life it had when it ended

    @property
    def stopped(self) -> bool:
        """Stopped (state T in /proc): only children are looked at (a joiner may be elsewhere)."""
        if isinstance(self.process, Replica):
            return self.process.stopped()
        return not isinstance(self.process, RemoteProcess) and is_stopped(self.process.pid)


class Replica:
    """The `--shard-group` S processes of one HSDP replica, a failure domain, with Popen's verbs
    ([Note: HSDP replicas] in replica.py): it has ended when all of its processes ended with 0,
    or as soon as one ended otherwise, and then the others are killed (their shard group is
    broken: the replica is lost as a whole and replaced as a whole). Its pid is its first
    process's, the one that reports for it."""

    def __init__(self, processes: list[subprocess.Popen | ForkedProcess]):
        self.processes = processes
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.processes]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            self.kill()
            for process in self.processes:
                process.wait()
            self.returncode = failed
        elif all(c == 0 for c in codes):
            self.returncode = 0
        return self.returncode

    def stopped(self) -> bool:
        return any(is_stopped(p.pid) for p in self.processes if p.poll() is None)

    def send_signal(self, how: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(how)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self.processes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            process.wait(left)  # subprocess.TimeoutExpired past the deadline
        return self.poll()

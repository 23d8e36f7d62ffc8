"""The launcher of `dataparallel train --recovery live`: starts the workers, watches them, decides
each generation, and starts replacements ([Note: live recovery] in recovery.py).

torchrun's agent stops every worker when one fails, which is what live recovery must not do;
so in live mode the launcher starts the workers itself (one machine in this version), hosts
the store they meet in, and is the quorum's one decider ([Note: membership] in
comm/membership.py). Each worker is a slot 0..N-1; the loop, every `poll_s`:
- reaps the workers that ended: 0 is a finished run, 2 is bad input (all workers stop
  together), anything else is a loss: the slot gets a replacement (up to --max-restarts in
  all), which builds its state alone and asks to join;
- reads the reports for the next generation and applies `decide`; a member that never
  reports within --collective-timeout + 10 s of the first report is stalled (one stopped,
  state T in /proc, at once): it is killed (SIGKILL also ends a stopped process) and replaced like a dead
  one;
- when a replacement waits, asks the members to regroup at their next step boundary.
Every slot is replaced alike, slot 0 too: the run's records are written by rank 0 of the
current generation, so that role moves with the membership ([Note: the writer role] in
train/writer.py).
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch.distributed as dist

import dataparallel as dp

from ..comm.membership import (
    Membership,
    QuorumError,
    QuorumPolicy,
    decide,
    first_membership,
    left_out,
    waiting_to_join,
)
from ..comm.quorum import QuorumHost, host_store
from .config import RunConfig
from .recovery import ENV_LIVE, STORE_PREFIX
from .stopped_workers import is_stopped

WORKER_MODULE = "dataparallel.train.worker"
STOP_GRACE_S = 30.0  # what a worker told to stop has to finish (a checkpoint write)
REPORT_GRACE_S = 10.0  # beyond the collective timeout, for a member's rewind and report


class Life(enum.Enum):
    """A worker process's state, as the launcher sees it."""

    STARTING = "starting"  # a replacement, not yet let into a generation
    MEMBER = "member"  # in the current generation (or the first workers, before it)
    ENDED = "ended"


@dataclass
class Worker:
    """One process in a slot."""

    slot: int
    process: subprocess.Popen
    life: Life
    code: int | None = None


@dataclass
class Tally:
    """What the launcher tells at the end: replacements started, generations formed."""

    replacements: int = 0
    generations: list = field(default_factory=list)


class LiveLauncher:
    """Runs the workers of one live run on this machine until they end.

    config: the validated run; launch.nproc workers, launch.max_restarts replacements in all,
        launch.collective_timeout the time a member has to report.
    env: added to every worker's environment (the resolved config, the thread count...).
    poll_s: how often the workers and the store are looked at.
    """

    def __init__(self, config: RunConfig, env: dict[str, str], poll_s: float = 0.02):
        self.config, self.env, self.poll_s = config, env, poll_s
        self.slots = config.launch.nproc
        # A member blocked on another member reports once its collective times out.
        timeout = config.launch.collective_timeout + REPORT_GRACE_S
        self.policy = QuorumPolicy(join_timeout_s=timeout)
        self.port = dp.free_port()
        self.store = host_store(self.port)
        self.host = QuorumHost(dist.PrefixStore(STORE_PREFIX, self.store), self.slots)
        self.current: Membership = first_membership(self.slots)
        self.workers: dict[int, Worker] = {}
        self.first_report_at: float | None = None
        self.asked_regroup = -1  # the last generation asked to let a replacement in
        self.tally = Tally()

    def run(self) -> int:
        """Start the workers and watch them; the exit status (0, 1, 2, or 130 on Ctrl-C)."""
        for slot in range(self.slots):
            self._start(slot, joining=False)
        try:
            while True:
                status = self._reap()
                if status is not None:
                    return status
                self._decide()
                time.sleep(self.poll_s)
        except QuorumError as error:
            self._say(f"error: {error}")
            self._stop_all()
            return 1
        except KeyboardInterrupt:
            self._stop_all(signal.SIGINT)
            return 130

    # -- processes ------------------------------------------------------------------------------
    def _start(self, slot: int, *, joining: bool) -> None:
        live = {"store": f"127.0.0.1:{self.port}", "replica": slot, "joining": joining}
        env = {**os.environ, **self.env, ENV_LIVE: json.dumps(live)}
        process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env)
        life = Life.STARTING if joining else Life.MEMBER
        self.workers[slot] = Worker(slot, process, life)

    def _reap(self) -> int | None:
        """Note the workers that ended and replace the lost ones; the run's exit status once
        no member is left, else None."""
        finishing = any(w.life is Life.ENDED and w.code in (0, 2) for w in self.workers.values())
        for worker in list(self.workers.values()):
            if worker.life is Life.ENDED or worker.process.poll() is None:
                continue
            was_member = worker.life is Life.MEMBER
            worker.life, worker.code = Life.ENDED, worker.process.returncode
            if worker.code in (0, 2) or finishing or not was_member:
                continue
            if self.tally.replacements < self.config.launch.max_restarts:
                self.tally.replacements += 1
                self._say(
                    f"worker {worker.slot} (pid {worker.process.pid}) ended with status "
                    f"{worker.code}; the others go on, and a replacement starts"
                )
                self._start(worker.slot, joining=True)
            else:
                self._say(f"worker {worker.slot} ended; no replacement left (--max-restarts)")
        if any(w.life is Life.MEMBER for w in self.workers.values()):
            return None
        self._stop_all()  # replacements still starting have nobody to join
        codes = {w.code for w in self.workers.values() if w.code is not None}
        return 0 if codes <= {0} else 2 if codes == {2} else 1

    def _stop_all(self, how: int = signal.SIGTERM) -> None:
        running = [w for w in self.workers.values() if w.process.poll() is None]
        for worker in running:
            worker.process.send_signal(how)
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in running:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()

    # -- the quorum -----------------------------------------------------------------------------
    def _decide(self) -> None:
        generation = self.current.generation + 1
        live_pids = {w.process.pid for w in self.workers.values() if w.life is not Life.ENDED}
        reports = {  # a report of a process that has died since does not count
            slot: report
            for slot, report in self.host.reports(generation).items()
            if report.pid in live_pids
        }
        if not reports:
            return
        now = time.monotonic()
        self.first_report_at = self.first_report_at or now
        # A stopped member cannot report: it is not waited for ([Note: membership]).
        alive = {
            s
            for s, w in self.workers.items()
            if w.life is Life.MEMBER and not is_stopped(w.process.pid)
        }
        decided = decide(self.current, reports, alive, now - self.first_report_at, self.policy)
        if decided is None:
            if waiting_to_join(reports) and self.asked_regroup < self.current.generation:
                self.asked_regroup = self.current.generation
                self.host.ask_regroup(self.current.generation)
            return
        self.host.publish(decided)
        for slot in decided.members:
            self.workers[slot].life = Life.MEMBER
        for slot in left_out(self.current, decided):
            worker = self.workers[slot]
            if worker.life is Life.MEMBER and worker.process.poll() is None:
                self._say(f"worker {slot} (pid {worker.process.pid}) stalled: killed")
                worker.process.kill()  # reaped, and replaced, on the next pass
        self.tally.generations.append(decided)
        if decided.generation > 0:
            pids = ", ".join(str(self.workers[s].process.pid) for s in decided.members)
            self._say(
                f"generation {decided.generation}: workers {list(decided.members)} (pids {pids}) "
                f"at step {decided.step}"
                + (f", healed {list(decided.healed)}" if decided.healed else "")
            )
        self.current, self.first_report_at = decided, None

    def _say(self, line: str) -> None:
        print(f"dataparallel train: live: {line}", file=sys.stderr, flush=True)


def launch_live(config: RunConfig, env: dict[str, str]) -> int:
    """Run `dataparallel train --recovery live` on this machine ([Note: live recovery])."""
    return LiveLauncher(config, env).run()

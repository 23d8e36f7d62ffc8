"""The launcher of `dataparallel train --recovery live`: starts the workers, watches them, decides
each generation, and starts replacements ([Note: live recovery] in recovery.py).

torchrun's agent stops every worker when one fails, which is what live recovery must not do;
so in live mode the launcher starts the workers itself (one machine in this version), hosts
the store they meet in, and is the quorum's one decider ([Note: membership] in
membership.py). Each replica (one worker process, or the S of an HSDP replica: `Replica`) has a
slot 0..N-1; the loop, every `poll_s`:
- reaps the workers that ended: 0 is a finished run, 2 is bad input (all workers stop
  together), anything else is a loss: the slot gets a replacement (up to --max-restarts in
  all), which builds its state alone and asks to join;
- reads the reports for the next generation and applies `decide`; a member that never
  reports within --collective-timeout + 10 s of the first report is stalled (one stopped,
  state T in /proc, at once): it is killed (SIGKILL also ends a stopped process) and replaced
  like a dead one;
- when a replacement or a joiner waits, or a member was released, asks the members to regroup
  at their next step boundary;
- answers the requests to join or leave made from outside it (`dataparallel join RUN_DIR`,
  `dataparallel leave RUN_DIR --replica K`; [Note: membership requests] in requests.py),
  within --min-replicas and --max-replicas. A joiner gets the next unused slot; it is not the
  launcher's child, so it is watched through its heartbeat (remote.py). A leaver is not
  replaced, and its leave is not counted against --max-restarts.
Every slot is replaced alike, slot 0 too: the run's records are written by rank 0 of the
current generation, so that role moves with the membership ([Note: the writer role] in
train/writer.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...launch.forked import ForkedProcess, forking_works
from ..config import RunConfig
from .membership import (
    JOIN,
    Membership,
    QuorumError,
    QuorumPolicy,
    decide,
    first_membership,
    gone,
    refuse_join,
    refuse_leave,
    waiting_to_join,
)
from .quorum import QuorumHost
from .remote import RemoteProcess
from .requests import Answer, Desk, Request
from .secret import ENV_SECRET_FILE, Gate, RunKey, make_secret
from .slots import Life, Replica, Worker
from .store import ENV_LIVE, RUN_FILE, RUN_KEY, HostedStore, run_store, write_run_file

WORKER_MODULE = "dataparallel.train.worker"
STOP_GRACE_S = 30.0  # what a worker told to stop has to finish (a checkpoint write)
REPORT_GRACE_S = 10.0  # beyond the collective timeout, for a member's rewind and report


class LiveLauncher:
    """Runs the workers of one live run on this machine until they end.

    config: the validated run; launch.nproc workers, launch.max_restarts replacements in all,
        launch.collective_timeout the time a member has to report, launch.min_replicas and
        launch.max_replicas the sizes, launch.store_host the address the store listens on
        (127.0.0.1 when not given), where joiners reach it.
    env: added to every worker's environment (the resolved config, the thread count...).
    run: the encoded run the workers train (in `env` too), which a joiner reads from the store.
    poll_s: how often the workers and the store are looked at.
    fork: this is a command's own process: its workers are forked from it where torch allows
        ([Note: forked workers] in launch/forked.py), else fresh interpreters.
    """

    def __init__(
        self,
        config: RunConfig,
        env: dict[str, str],
        run: str,
        poll_s: float = 0.02,
        *,
        fork: bool = False,
    ):
        self.config, self.env, self.run_text, self.poll_s = config, env, run, poll_s
        self.fork = fork and forking_works()  # [Note: forked workers] in launch/forked.py
        self.shard = config.layout.shard  # processes per replica ([Note: layout])
        self.slots = config.launch.nproc // self.shard
        self.starts = 0  # replicas started: each replacement replica meets its own ranks
        # A member blocked on another member reports once its collective times out.
        timeout = config.launch.collective_timeout + REPORT_GRACE_S
        self.policy = QuorumPolicy(
            join_timeout_s=timeout,
            min_replicas=config.launch.min_replicas,
            max_replicas=config.launch.max_replicas or self.slots,
        )
        # Bound to the run's address only; every request and report sealed with the run's
        # secret ([Note: signed requests] in secret.py; docs/security.md).
        self.hosted = HostedStore(config.launch.store_host or "127.0.0.1")
        self.store = self.hosted.store
        given = os.environ.get(ENV_SECRET_FILE)  # a Kubernetes Secret, mounted as a file
        self.secret_file = Path(given) if given else make_secret(Path(config.launch.out))
        self.key = key = RunKey.read(self.secret_file)
        self.host = QuorumHost(run_store(self.store), self.slots, key, self._say)
        self.desk = Desk(self.host.store, Gate(key), self._say)  # joins and leaves from outside
        self.current: Membership = first_membership(self.slots)
        self.workers: dict[int, Worker] = {}
        self.first_report_at: float | None = None
        self.first_timeout_at: float | None = None  # of a report of a timed-out collective
        self.asked_regroup = -1  # the last generation asked to let a replica in, or one out
        self.replacements = 0  # started, in all (--max-restarts)

    def run(self) -> int:
        """Start the workers and watch them; the exit status (0, 1, 2, or 130 on Ctrl-C)."""
        run_dir = Path(self.config.launch.out)
        # What a joiner trains, sealed: a config written by another could make it run anything.
        self.host.store.set(RUN_KEY, self.key.seal(self.run_text, purpose=RUN_KEY))
        write_run_file(run_dir, self.hosted.address)
        for slot in range(self.slots):
            self._start(slot, joining=False)
        try:
            while True:
                status = self._reap()
                if status is not None:
                    return status
                self._answer_requests()
                self._decide()
                time.sleep(self.poll_s)
        except QuorumError as error:  # BelowMinimum too
            self._say(
                f"error: {error}; the run stops: continue with: dataparallel train --resume "
                f"{self.config.launch.out}"
            )
            self._stop_all()
            return 1
        except KeyboardInterrupt:
            self._stop_all(signal.SIGINT)
            return 130
        finally:
            (run_dir / RUN_FILE).unlink(missing_ok=True)  # nobody joins a run that has ended

    # -- processes ------------------------------------------------------------------------------
    def _start(self, slot: int, *, joining: bool) -> None:
        """Start the replica in `slot`: one process, or the S of an HSDP replica."""
        self.starts += 1
        processes = []
        for index in range(self.shard):
            live = {
                "store": self.hosted.address,
                "replica": slot,
                "joining": joining,
                "index": index,
                "shard": self.shard,
                "start": self.starts,
                "secret": str(self.secret_file.resolve()),
            }
            env = {**os.environ, **self.env, ENV_LIVE: json.dumps(live)}
            if self.fork:
                name = f"dp slot {slot}.{index}"
                processes.append(ForkedProcess(WORKER_MODULE, env, name))
            else:
                processes.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env))
        process = processes[0] if self.shard == 1 else Replica(processes)
        life = Life.STARTING if joining else Life.MEMBER
        self.workers[slot] = Worker(slot, process, life)

    def _reap(self) -> int | None:
        """Note the workers that ended and replace the lost ones; the run's exit status once
        no member is left, else None."""
        finishing = any(  # a member ended the run (a replica that never got in did not)
            w.ended_as is Life.MEMBER and w.code in (0, 2) for w in self.workers.values()
        )
        for worker in list(self.workers.values()):
            if worker.life is Life.ENDED or worker.process.poll() is None:
                continue
            worker.ended_as = worker.life
            worker.life = Life.ENDED
            worker.code = worker.process.returncode
            if worker.ended_as is Life.RELEASED:
                self._say(f"worker {worker.slot} left with status {worker.code}; not replaced")
            if worker.code in (0, 2) or finishing or worker.ended_as is not Life.MEMBER:
                continue
            if isinstance(worker.process, RemoteProcess):  # the launcher cannot start it again
                self._say(
                    f"worker {worker.slot} (joined, pid {worker.process.pid}) ended with status "
                    f"{worker.code}; the others go on without it"
                )
                continue
            if self.replacements < self.config.launch.max_restarts:
                self.replacements += 1
                self._say(
                    f"worker {worker.slot} (pid {worker.process.pid}) ended with status "
                    f"{worker.code}; the others go on, and a replacement starts"
                )
                self._start(worker.slot, joining=True)
            else:
                self._say(f"worker {worker.slot} ended; no replacement left (--max-restarts)")
        if any(w.life in (Life.MEMBER, Life.RELEASED) for w in self.workers.values()):
            return None
        self._stop_all()  # replacements still starting have nobody to join
        # The run's status is its last generation's: a replica lost and left behind earlier
        # (a joiner, or one past --max-restarts) was reported when it was lost.
        last = [self.workers[s] for s in self.current.members if s in self.workers]
        codes = {w.code for w in last or self.workers.values() if w.code is not None}
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

    # -- joins and leaves asked from outside ------------------------------------------------------
    def _answer_requests(self) -> None:
        for number, request in self.desk.pending():
            answer = self._admit(request) if request.kind == JOIN else self._release(request)
            self.desk.answer(number, answer)

    def _admit(self, request: Request) -> Answer:
        """A new replica, within --max-replicas: the next unused slot, watched by heartbeat."""
        who = f"pid {request.pid} on {request.host}"
        counted = [w for w in self.workers.values() if w.life in (Life.STARTING, Life.MEMBER)]
        refusal = refuse_join(len(counted), self.policy)
        if refusal:
            self._say(f"a replica asked to join ({who}): refused: {refusal}")
            return Answer(ok=False, message=refusal)
        slot, self.host.slots = self.host.slots, self.host.slots + 1
        process = RemoteProcess(self.host.store, slot, request.pid)
        self.workers[slot] = Worker(slot, process, Life.STARTING)
        self._say(f"worker {slot} ({who}) joins; it is let in at the members' next step boundary")
        return Answer(ok=True, replica=slot, message=f"joined as replica {slot}")

    def _release(self, request: Request) -> Answer:
        """A member leaves at its next step boundary, if --min-replicas stay."""
        members = [s for s, w in self.workers.items() if w.life is Life.MEMBER]
        # The writer (rank 0, the lowest member) may leave too: the role moves to the next
        # lowest ([Note: the writer role] in train/writer.py).
        refusal = refuse_leave(request.replica, members, self.policy)
        if refusal:
            self._say(f"replica {request.replica} asked to leave: refused: {refusal}")
            return Answer(ok=False, message=refusal)
        self.workers[request.replica].life = Life.RELEASED
        self.host.release(request.replica)
        message = f"replica {request.replica} leaves at its next step boundary"
        self._say(message)
        return Answer(ok=True, message=message)

    # -- the quorum -----------------------------------------------------------------------------
    def _decide(self) -> None:
        generation = self.current.generation + 1
        reports = {  # a report counts only from the process now in its slot, still running
            slot: report
            for slot, report in self.host.reports(generation).items()
            if slot in self.workers
            and self.workers[slot].life is not Life.ENDED
            and report.pid == self.workers[slot].process.pid
        }
        self._ask_regroup(reports)
        if not reports:
            return
        now = time.monotonic()
        # A stopped member cannot report: it is not waited for ([Note: membership]).
        # A leaver is waited for too: it reports LEAVE (or STEP, if it regrouped before it knew).
        in_run = (Life.MEMBER, Life.RELEASED)
        alive = {s for s, w in self.workers.items() if w.life in in_run and not w.stopped}
        # The wait starts at a member's report: replacements and joiners asking in alone (the
        # members evaluating, saving or still starting) wait for them, not against the clock;
        # unless no member is left to come.
        member_spoke = any(s in self.current.slots and r.where != JOIN for s, r in reports.items())
        if member_spoke or not alive:
            self.first_report_at = self.first_report_at or now
        arriving = sum(
            1 for s, w in self.workers.items() if w.life is Life.STARTING and s not in reports
        )
        if any(r.timed_out for r in reports.values()):
            self.first_timeout_at = self.first_timeout_at or now
        waited = now - self.first_report_at if self.first_report_at else 0.0
        timed_out = now - self.first_timeout_at if self.first_timeout_at else None
        decided = decide(self.current, reports, alive, waited, self.policy, arriving, timed_out)
        if decided is None:
            return
        self.host.publish(decided)
        for slot in decided.members:
            if self.workers[slot].life is Life.STARTING:
                self.workers[slot].life = Life.MEMBER
        for slot in gone(self.current, decided):
            worker = self.workers[slot]
            silent = slot not in reports  # a leaver reported LEAVE and goes by itself
            if worker.life in in_run and silent and worker.process.poll() is None:
                self._say(f"worker {slot} (pid {worker.process.pid}) stalled: killed")
                worker.process.kill()  # reaped, and replaced, on the next pass
        pids = ", ".join(str(self.workers[s].process.pid) for s in decided.members)
        self._say(
            f"generation {decided.generation}: workers {list(decided.members)} (pids {pids}) "
            f"at step {decided.step}"
            + (f", healed {list(decided.healed)}" if decided.healed else "")
        )
        self.current, self.first_report_at, self.first_timeout_at = decided, None, None

    def _ask_regroup(self, reports: dict) -> None:
        """Ask the current generation to regroup at its next step boundary when a replica waits
        to join or a member was released (once per generation)."""
        released = any(self.workers[s].life is Life.RELEASED for s in self.current.members)
        if not (released or waiting_to_join(reports)):
            return
        if self.asked_regroup < self.current.generation:
            self.asked_regroup = self.current.generation
            self.host.ask_regroup(self.current.generation)

    def _say(self, line: str) -> None:
        print(f"dataparallel train: live: {line}", file=sys.stderr, flush=True)


def launch_live(config: RunConfig, env: dict[str, str], run: str, *, fork: bool = False) -> int:
    """Run `dataparallel train --recovery live` on this machine ([Note: live recovery]): the
    workers train `run` (encoded, as in `env`); `fork`: forked from this process, a command's
    own ([Note: forked workers] in launch/forked.py)."""
    return LiveLauncher(config, env, run, fork=fork).run()

"""Preemption: SIGTERM or SIGUSR1 asks a run to save and stop, and the job to be started again.

[Note: preemption] A scheduler that takes the machines back signals the job first: Slurm sends
SIGTERM at `scancel` and preemption (and the signal of `--signal=USR1@T` T seconds before the
time limit), to the batch script or to every task; Kubernetes sends SIGTERM at eviction. Then
it waits its grace (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds: 30 s by
default) and sends SIGKILL. So:

- The launcher takes SIGTERM and SIGUSR1 (`LauncherSignals`): the first one raises torch's
  SignalException in the elastic agent, which stops for good (no restart) and passes the same
  signal on to the workers; it waits for them `preempt_budget` seconds (the agent's shutdown
  timeout, 25 s by default: 5 s inside the schedulers' 30) and then SIGKILLs the ones left. A
  second signal is noted on one line and changes nothing: the save goes on within the same
  budget. The launcher then exits with PREEMPTED.
- A worker takes them too (`WorkerSignals`; Slurm signals every task, and a worker may be the
  task): the handler only raises a flag. A SIGTERM to a worker of our launcher is a preemption
  only once the launcher was preempted: torch's agent also stops the survivors of a failure
  with SIGTERM, and those end at once as before (a stalled worker's run ends within the
  collective timeout plus a few seconds, [Note: stopped workers]). The launcher marks its
  preemption (`preempting(pid)`, a file) before it passes the signal on; a worker's SIGTERM
  waits for the mark up to MARK_WAIT_S (Slurm may signal the workers before their launcher)
  and ends the worker when none comes. SIGUSR1 always means preemption (the agent never sends
  it). At the next step boundary the ranks agree on the flag
  (train/preemption.py: one 1-element all-reduce per step), so every rank stops after the same
  step; a worker under our launcher tells it (the same signal), they write one synchronous
  checkpoint of that step (or keep the one of that step already written) and exit with
  PREEMPTED. A later signal changes nothing.
- Once the checkpoint is committed (and a worker's process group destroyed), the worker and
  the launcher end with `exit_now`: the interpreter's own finalization (torch's modules and
  native destructors, no Python frame left) took 6-7 s more per process on this loaded
  machine, a quarter of the budget, and a launcher SIGKILLed by the scheduler meanwhile would
  end with 137 instead of PREEMPTED.
- When the save does not fit the budget, the SIGKILL stops it mid-write: the folder being
  written stays `step-N.tmp` and the previous checkpoint stays the latest and whole ([Note:
  atomic checkpoints] in checkpoint/folders.py). The run loses the steps since that one.
- The job files requeue on PREEMPTED, and the same command with `--resume auto` continues from
  the latest complete checkpoint (docs/train.md; docs/faults.md, "Preemption").

A live run (`--recovery live`) has its own launcher and takes no part: SIGTERM ends it as
before, and it resumes from its last periodic checkpoint.

[Note: signals on the main thread] Python lets only the main thread of the main interpreter
install a signal handler (`signal.signal` raises "signal only works in main thread of the main
interpreter" anywhere else). Ray Train runs the training function on a thread of its own, so
`dataparallel.cli.main(["train", ...])` there installs none (`signals_allowed`): no handler, no
preemption flag, and the signals keep the handlers of the process that owns the thread (Ray's
worker), which rank 0 says in one line (train/worker.py NO_PREEMPTION). Our launcher and a
worker it starts, torchrun's, Slurm's and mpirun's workers all run the command on their main
thread and take preemption as above. torch's agent makes the same test for its own
handlers (torch.distributed.elastic.multiprocessing.api, `PContext.start`).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry"
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEFAULT_BUDGET_S = 25.0
MARK_WAIT_S = 2.0  # how long a worker's SIGTERM waits for its launcher's mark
# The signals torch's agent keeps handling itself (Ctrl-C and the like: status 130).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def signals_allowed() -> bool:
    """Whether this thread may install signal handlers: the main thread of the main interpreter
    ([Note: signals on the main thread])."""
    return threading.current_thread() is threading.main_thread() and _in_main_interpreter()


def _in_main_interpreter() -> bool:
    """Whether this is the main interpreter, not a subinterpreter (whose first thread is its own
    `threading.main_thread()` and still may not install handlers). CPython's private modules,
    checked on 3.10 to 3.13: `get_current()` equals `get_main()` only in the main interpreter."""
    try:
        import _interpreters as interpreters  # CPython 3.13 and later
    except ImportError:
        try:
            import _xxsubinterpreters as interpreters  # CPython 3.10 to 3.12
        except ImportError:  # no subinterpreters to be in
            return True
    return interpreters.get_current() == interpreters.get_main()


def preempting(launcher_pid: int) -> Path:
    """The mark a preempted launcher leaves before it passes the signal on to its workers."""
    return Path(tempfile.gettempdir()) / f"dataparallel-preempting-{launcher_pid}"


class LauncherSignals:
    """The launcher's handlers of SIGTERM and SIGUSR1 while the agent runs ([Note: preemption]).

    The first signal raises torch's SignalException (the agent then stops the workers with it);
    later ones print one line and return. `received` is the first signal, or None.
    """

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.received: signal.Signals | None = None
        self.repeated = False  # said once: the workers pass the signal on too
        self._previous: dict = {}

    def install(self) -> LauncherSignals:
        """Take the signals; on a thread that may not ([Note: signals on the main thread])
        leave them as they are: the agent, on the same thread, takes none either."""
        if not signals_allowed():
            return self
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        preempting(os.getpid()).unlink(missing_ok=True)

    def _handle(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        if self.received is not None:
            if self.repeated:
                return
            self.repeated = True
            print(
                f"dataparallel: {sig.name} again: the checkpoint is being written; the workers "
                f"stop within {self.budget_s:g} s of the first signal",
                file=sys.stderr,
                flush=True,
            )
            return
        self.received = sig
        preempting(os.getpid()).touch()  # before the agent passes it on: the workers save
        print(
            f"dataparallel: {sig.name}: preempted; the workers finish their step and save a "
            f"checkpoint (at most {self.budget_s:g} s), then the launcher exits {PREEMPTED}",
            file=sys.stderr,
            flush=True,
        )
        raise SignalException(f"got {sig.name}", sigval=sig)


class WorkerSignals:
    """A worker's handlers of SIGTERM and SIGUSR1: they raise a flag, read at the next step
    boundary ([Note: preemption]). `received` is the first signal, or None."""

    def __init__(self, launcher_pid: int | None = None):
        self.received: signal.Signals | None = None
        self.launcher_pid = launcher_pid  # our launcher's (ENV_LAUNCHER), None without one

    def install(self) -> WorkerSignals:
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and self.received is None and not self._preempting():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent stops us: end as before
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.received is None:
            self.received = signal.Signals(signum)

    def _preempting(self) -> bool:
        """Whether this SIGTERM is a preemption: no launcher of ours (the scheduler's own task,
        torchrun started by hand), or our launcher marked its preemption (waited for briefly)."""
        if self.launcher_pid is None:
            return True
        mark, deadline = preempting(self.launcher_pid), time.monotonic() + MARK_WAIT_S
        while not mark.exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def exit_now(code: int = PREEMPTED) -> None:
    """End this process with `code` at once (output flushed, no interpreter finalization): a
    preempted process whose checkpoint is committed ([Note: preemption])."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

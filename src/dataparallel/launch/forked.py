"""Workers forked from the launcher: our own workers start without importing torch again.

[Note: forked workers] A worker started as a fresh interpreter (`python -m MODULE`, torchrun's
way) spends 5-6 s of a core importing torch and dataparallel before its first step, every
worker and every restart: 11 s of the 2 cores for a 2-worker `dataparallel train` of 12 steps
that trains for 2 s. The launcher has imported both already, so on Linux with a CPU build of
torch its own workers (`dataparallel train`, `generate`, `eval`) are forked from it instead,
through torch.distributed.run's own start method for function entry points (`fork`): the same
agent, rendezvous, restarts, signals and exit statuses, and the workers are still the
launcher's children. The live launcher (`--recovery live`), which starts its workers itself,
forks them as `ForkedProcess`es, replacements too. A user's script (`dataparallel launch`) and
a joiner (`dataparallel join`) always start fresh.

A fork is a fresh process only where the launcher has left nothing that a fresh one would
not have, so it is used only when all of this holds:
- the caller is a command's own process (`cli.main` run as a program), which has computed
  nothing in parallel: a forked child of a process whose OpenMP pool had threads waits forever
  in its first parallel region (GNU OpenMP is not fork-safe), and such a process keeps one
  torch thread (`launcher_threads`);
- torch is a CPU build: CUDA (and ROCm) cannot be used in a child forked after the driver was
  initialised, and a launcher may have asked it for its devices;
- Linux: elsewhere fork is unsafe (macOS) or absent (Windows).
The child then undoes what it inherited and a fresh interpreter would not have (`as_fresh`):
the launcher's signal handlers and its wakeup descriptor, its one thread. The launcher's other
threads (the store server of torchrun's agent or of the live launcher) are not in the child,
which uses none of their objects: it meets the others through a store client of its own.
Everything else (the environment, with torchrun's per-rank variables over it; the working
directory; the standard streams) is what a fresh worker inherits too.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import traceback


def forking_works() -> bool:
    """Whether this machine's torch can run in a process forked from this one (Linux, a CPU
    build: [Note: forked workers])."""
    import torch

    return sys.platform == "linux" and torch.version.cuda is None and torch.version.hip is None


def launcher_threads() -> None:
    """One torch thread for a command's own process: it computes nothing in parallel (its
    workers do), so OpenMP never makes a pool that its forked workers would inherit."""
    import torch

    torch.set_num_threads(1)


def as_fresh() -> None:
    """In a forked worker: undo what it inherited that a fresh interpreter does not have. The
    launcher's Python signal handlers become the default (SIGINT: KeyboardInterrupt, as in any
    Python program), signals no longer wake the launcher's descriptor, and torch's threads are
    the worker's own (OMP_NUM_THREADS, set by the launcher: OpenMP read it when the launcher
    started, before the launcher set it)."""
    import torch

    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def name_process(name: str) -> None:
    """`name` (at most 15 bytes) as this process's name in ps and /proc/PID/comm: a forked
    worker's command line is its launcher's, and its /proc/PID/environ the launcher's too (the
    environment a process was started with), so its name tells which rank it is."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # PR_SET_NAME is Linux's: nothing to name elsewhere
        pass


def run_module(module: str, name: str | None = None) -> int:
    """The entry point of a forked worker: `python -m MODULE` without the interpreter's start
    (MODULE's `main()`, whose return is the exit status), named `name` ("dp rank RANK" if
    None: torchrun's workers)."""
    as_fresh()
    name_process(name or f"dp rank {os.environ.get('RANK', '?')}")
    return importlib.import_module(module).main()


class ForkedProcess:
    """`python -m MODULE` with `env` as its whole environment, forked from this process: the
    live launcher's workers ([Note: forked workers]), with the verbs of subprocess.Popen it
    uses (pid, returncode, poll, wait, send_signal, terminate, kill; a signal's end is its
    negative number, as Popen says). `name` is the process's name in ps (15 bytes)."""

    def __init__(self, module: str, env: dict[str, str], name: str):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker: it never returns from here
            _run_child(module, env, name)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"dataparallel worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_child(module: str, env: dict[str, str], name: str) -> None:
    """A forked worker's life: MODULE's main() in `env`, then the process ends with its status
    (as `python -m MODULE` would; the launcher's exit handlers are not its own: none runs)."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        code = run_module(module, name)
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
        if isinstance(end.code, str):
            print(end.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code or 0)


def start_forked(argv: list[str]) -> None:
    """torch.distributed.run's `run` for `argv` (torchrun's arguments ending with `--module
    MODULE`), with MODULE's workers forked from this process."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    *flags, option, module = argv
    if option != "--module":
        raise ValueError(f"start_forked: {argv[-2:]} is not --module MODULE")
    args = parse_args([*flags, "--start-method=fork", option, module])
    config, _, _ = config_from_args(args)
    elastic_launch(config=config, entrypoint=run_module)(module)

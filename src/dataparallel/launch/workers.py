"""Starting the workers: PyTorch's elastic launcher (torch.distributed.run), set up for the user.

One machine: `--nproc N` starts N workers that meet at 127.0.0.1 on a free port. Several
machines: each runs the same command with `--nnodes`, its `--node-rank` and node 0's
`--rdzv-endpoint host:port`, and the workers meet there (static rendezvous: a fixed set of
nodes, no elastic membership changes).

[Note: threads per worker] Each worker gets max(1, cores // workers on this machine) torch
threads through OMP_NUM_THREADS. Left alone, every worker would start one thread per core, and
N workers would run N x cores threads on `cores` cores; on a 2-core machine 2 workers with 2
threads each ran 11x slower than with 1 thread each (threads spin-waiting for cores that are
busy). torchrun's own default is 1 thread, which wastes cores when workers are fewer than cores.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os

from ..runtime import ENV_CHECK_COLLECTIVES, ENV_COLLECTIVE_TIMEOUT, free_port
from .config import LaunchConfig
from .forked import forking_works, start_forked
from .preemption import AGENT_SIGNALS, PREEMPT_SIGNALS, PREEMPTED, LauncherSignals
from .stopped_workers import StoppedWorkers

ENV_LAUNCHER = "DATAPARALLEL_LAUNCHER_PID"  # the launcher's pid, the workers' parent


def freeze_imports() -> None:
    """Called first by each process entry point (`dataparallel`, a train or inference worker).

    [Note: frozen imports] torch, dataparallel and their imports leave some 250,000 objects that
    live as long as the process, and each full collection walks them all (0.1-0.4 s on 2
    cores). `gc.freeze()` moves them to the collector's permanent generation: no collection
    walks them again, and the interpreter's exit, which collects several times while it
    unloads modules, no longer takes 0.6-1 s per process (a 2-worker `dataparallel train` of
    4 steps ended 3-8 s sooner, three processes each exiting faster). Objects made afterwards
    are collected as usual. Not called when `cli.main` is handed its arguments (the tests call
    it in their own process).
    """
    gc.freeze()


def available_cores() -> int:
    """Cores this process may run on (respects taskset / container CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def fair_threads(nproc: int, cores: int | None = None) -> int:
    """Torch threads per worker so that `nproc` workers share the cores without oversubscribing."""
    return max(1, (cores or available_cores()) // nproc)


def torchrun_argv(launch: LaunchConfig, entry: list[str], port: int | None = None) -> list[str]:
    """The arguments for torch.distributed.run that start this machine's workers of `entry`
    (["--module", NAME, ...] or [SCRIPT, ...args]), as `launch` says."""
    if launch.nnodes == 1:
        host, port = "127.0.0.1", port or free_port()
    else:
        host, _, port_text = launch.rdzv_endpoint.rpartition(":")
        port = int(port_text)
    return [
        f"--nnodes={launch.nnodes}",
        f"--node-rank={launch.node_rank}",
        f"--nproc-per-node={launch.nproc}",
        f"--master-addr={host}",
        f"--master-port={port}",
        f"--max-restarts={launch.max_restarts}",  # [Note: restarts] in train/worker.py
        f"--signals-to-handle={AGENT_SIGNALS}",  # SIGTERM, SIGUSR1: [Note: preemption]
        *shutdown_timeout(launch.preempt_budget),
        *entry,
    ]


@functools.cache
def agent_flags() -> frozenset[str]:
    """The options this torch's torch.distributed.run accepts."""
    from torch.distributed.run import get_args_parser

    return frozenset(get_args_parser()._option_string_actions)


# torchrun before 2.13 has no --shutdown-timeout: its agent waits a fixed 30 s for the workers
# to stop after it signals them, longer than the default preemption budget (25 s).
AGENT_FIXED_SHUTDOWN_S = 30


def shutdown_timeout(budget: float, flags: frozenset[str] | None = None) -> list[str]:
    """`--shutdown-timeout` of `budget` whole seconds, where this torchrun has that option;
    nothing where it has not (the agent's own AGENT_FIXED_SHUTDOWN_S then)."""
    if "--shutdown-timeout" in (agent_flags() if flags is None else flags):
        return [f"--shutdown-timeout={math.ceil(budget)}"]
    return []


def worker_environment(launch: LaunchConfig) -> dict[str, str]:
    """What every worker finds in its environment: its threads ([Note: threads per worker]),
    the watchdog's settings ([Note: launcher settings] in runtime.py), the launcher's pid."""
    return {
        "OMP_NUM_THREADS": str(launch.threads or fair_threads(launch.nproc)),
        ENV_COLLECTIVE_TIMEOUT: repr(float(launch.collective_timeout)),
        ENV_CHECK_COLLECTIVES: "1" if launch.check_collectives else "0",
        ENV_LAUNCHER: str(os.getpid()),  # train/worker.py's die_with_launcher
    }


def start_workers(
    launch: LaunchConfig, entry: list[str], env: dict[str, str] | None = None, *, fork: bool = False
) -> int:
    """Run this machine's workers of `entry` under torch.distributed.run until they end; return
    the exit status (0, 1 when a worker failed for good, 130 on Ctrl-C, PREEMPTED (75) after a
    SIGTERM or SIGUSR1: [Note: preemption] in preemption.py).

    `env` is added to the workers' environment (with `worker_environment`); the workers of
    `dataparallel train` get their resolved config there, so they need no shared file system.
    `fork`: the caller is a command's own process, and an `entry` of ["--module", NAME] is
    forked from it where torch allows ([Note: forked workers] in forked.py).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's warnings (the signal it got on Ctrl-C, the workers it stopped) repeat what the
    # workers say better; its errors (a worker that failed) stay.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)  # each sets its own level
    os.environ.update({**worker_environment(launch), **(env or {})})
    # A stopped worker told to end is continued, so it ends now, not after the agent's 30 s
    # grace ([Note: stopped workers] in stopped_workers.py).
    stopped = StoppedWorkers().start()
    signals = LauncherSignals(launch.preempt_budget).install()
    try:
        argv = torchrun_argv(launch, entry)
        if fork and entry[0] == "--module" and forking_works():
            start_forked(argv)
        else:
            run(parse_args(argv))
    except ChildFailedError as failed:
        # torch.distributed.run has printed which rank failed and its traceback. Workers that
        # all exited 2 found bad input together (data read by the workers, a checkpoint that
        # does not fit): rank 0 has said which on one line, and the command exits 2 as well.
        # Workers that all exited PREEMPTED were signalled themselves and saved.
        codes = {failure.exitcode for failure in failed.failures.values()}
        return {frozenset({2}): 2, frozenset({PREEMPTED}): PREEMPTED}.get(frozenset(codes), 1)
    except (KeyboardInterrupt, SignalException) as error:
        # The agent passed the signal on to the workers and waited for them. SIGTERM, SIGUSR1:
        # preempted ([Note: preemption]). Ctrl-C: rank 0 of `dataparallel train` has said
        # where the run stopped and how to resume it.
        if getattr(error, "sigval", None) in PREEMPT_SIGNALS:
            return PREEMPTED
        return 130
    finally:
        signals.restore()
        stopped.stop()
    return 0


def launch_script(launch: LaunchConfig, script: str, args: list[str]) -> int:
    """`dataparallel launch`: run the user's `script` with `args` in each worker, as torchrun
    would, with our threads, restarts, watchdog settings and per-attempt store (`dp.init()`)."""
    return start_workers(launch, [script, *args])

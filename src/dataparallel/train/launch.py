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

import logging
import os

import dataparallel as dp

from .config import RunConfig
from .worker import ENV_LAUNCHER, ENV_RUN, encode_run

WORKER_MODULE = "dataparallel.train.worker"


def available_cores() -> int:
    """Cores this process may run on (respects taskset / container CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def fair_threads(nproc: int, cores: int | None = None) -> int:
    """Torch threads per worker so that `nproc` workers share the cores without oversubscribing."""
    return max(1, (cores or available_cores()) // nproc)


def torchrun_argv(config: RunConfig, port: int | None = None) -> list[str]:
    """The arguments for torch.distributed.run that start this machine's workers."""
    launch = config.launch
    if launch.nnodes == 1:
        host, port = "127.0.0.1", port or dp.free_port()
    else:
        host, _, port_text = launch.rdzv_endpoint.rpartition(":")
        port = int(port_text)
    return [
        f"--nnodes={launch.nnodes}",
        f"--node-rank={launch.node_rank}",
        f"--nproc-per-node={launch.nproc}",
        f"--master-addr={host}",
        f"--master-port={port}",
        f"--max-restarts={launch.max_restarts}",  # [Note: restarts] in worker.py
        "--module",
        WORKER_MODULE,
    ]


def launch(config: RunConfig, *, resume: bool, checkpoint: str = "") -> int:
    """Start this machine's workers for the (validated) `config`; return the exit status.

    The workers get the resolved config through the environment (ENV_RUN), so they need no
    shared file system and train exactly what was checked here.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's warnings (the signal it got on Ctrl-C, the workers it stopped) repeat what the
    # workers say better; its errors (a worker that failed) stay.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)  # each sets its own level
    threads = config.launch.threads or fair_threads(config.launch.nproc)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # [Note: threads per worker]
    os.environ[ENV_RUN] = encode_run(config, resume, checkpoint)
    os.environ[ENV_LAUNCHER] = str(os.getpid())  # worker.die_with_launcher
    try:
        run(parse_args(torchrun_argv(config)))
    except ChildFailedError:
        # torch.distributed.run has printed which rank failed and its traceback.
        return 1
    except (KeyboardInterrupt, SignalException):
        # Ctrl-C: torch.distributed.run passed the signal on to the workers, and rank 0 has
        # said where the run stopped and how to resume it.
        return 130
    return 0

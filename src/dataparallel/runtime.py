"""Process-group set-up: `init()` reads torchrun's environment, or makes a world of one.

`init()` returns a `World` that callers pass on; nothing here is a module-level process-group
global that strategies read. A plain `python script.py` (no torchrun) gets a world of one on a
private in-memory store, so every code path is the same with one rank or many.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm.progress import PROGRESS
from .comm.watchdog import Watchdog
from .torch_internals import default_store, fake_store

# The process's watchdog, like the default process group it watches (one per process).
_watchdog: Watchdog | None = None

# [Note: launcher settings] `dataparallel launch` (and train's launcher) pass the watchdog's
# settings to the workers in these variables; `init()` reads them when its arguments are left
# out, so a user's script gets `--collective-timeout` and `--check-collectives` without code.
ENV_COLLECTIVE_TIMEOUT = "DATAPARALLEL_COLLECTIVE_TIMEOUT"
ENV_CHECK_COLLECTIVES = "DATAPARALLEL_CHECK_COLLECTIVES"


@dataclass(frozen=True)
class World:
    """Where this process stands in the job.

    rank: this process' index in the group, 0..world_size-1.
    world_size: number of processes that train together.
    local_rank: index among the processes of this machine (picks the GPU on CUDA).
    device: the device this rank computes on (`cuda:<local_rank>` when CUDA is there, else cpu).
    backend: "nccl" on CUDA, "gloo" on CPU.
    group: the process group of all ranks (torch's default group once initialised).
    attempt: how many times the launcher has restarted the workers (0 on the first start;
        torchrun's TORCHELASTIC_RESTART_COUNT): a restarted script resumes when it is above 0.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup
    attempt: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def attempt_store(timeout) -> dist.Store:
    """The launcher agent's store, under a prefix of its own for this restart of the workers.

    [Note: one store per attempt] Under torchrun, workers meet in the store its agent hosts.
    torch expects a fresh store after each restart ("we create a new TCPStore for every retry"),
    but the static rendezvous keeps one store for the whole job, so restarted workers found the
    dead workers' gloo addresses there and failed to connect, every time. Prefixing the store
    with the restart count (TORCHELASTIC_RESTART_COUNT) gives each attempt clean keys.
    """
    client = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"dataparallel/attempt_{attempt}", client)


def init(
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=10),
    threads: int | None = None,
    collective_timeout: float | None = None,
    check_collectives: bool | None = None,
) -> World:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    backend: "gloo", "nccl", or None to choose nccl when CUDA is available, else gloo.
    timeout: how long a collective may wait for a missing rank before it fails (not hangs).
    threads: torch intra-op threads for this rank; None leaves torch's setting (torchrun and our
        launcher set OMP_NUM_THREADS to a fair share of the cores).
    collective_timeout: seconds a collective may wait before a watchdog ends the process with
        one line naming the ranks that never arrived ([Note: watchdog] in comm/watchdog.py);
        0 starts no watchdog (then `timeout` ends a hang, with the backend's error). Keep it
        below `timeout`, or the backend's error comes first. None: the launcher's
        `--collective-timeout` (DATAPARALLEL_COLLECTIVE_TIMEOUT), else 0.
    check_collectives: before every collective, check that the ranks of its group call the same
        kind, shape and dtype, and raise `dp.comm.CollectiveMismatch` naming the first that
        differs ([Note: checked collectives] in comm/progress.py). A debug mode: slow. None:
        the launcher's `--check-collectives` (DATAPARALLEL_CHECK_COLLECTIVES), else off.

    Calling it again returns the same world. Without torchrun's variables it makes a world of one.
    A default process group made before (Ray Train's, the user's own) is adopted as it is, with
    its backend; `destroy()` then tears it down, so call it only where the group is done with.
    """
    collective_timeout, check_collectives = launcher_settings(collective_timeout, check_collectives)
    if not collective_timeout >= 0:
        raise ValueError(f"init: collective_timeout={collective_timeout} must be >= 0 (0: off)")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"init: threads={threads} must be >= 1")
        torch.set_num_threads(threads)
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"init: backend={backend!r} is not supported; use 'gloo' or 'nccl' (a dry run on "
            "the fake process group: dataparallel.init_fake)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = attempt_store(timeout)
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    group = dist.group.WORLD
    PROGRESS.check = check_collectives
    _start_watchdog(dist.get_rank(group), dist.get_world_size(group), collective_timeout)
    return World(
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(group),
        group=group,
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def init_fake(world_size: int, rank: int = 0) -> World:
    """A world of `world_size` ranks in which this process plays rank `rank`, on PyTorch's fake
    process group: every collective returns at once and leaves its tensors as they are, and
    object collectives return this rank's own value ([Note: dry run] in comm/dry.py). For a
    dry run of the engine at any scale in one process (`dataparallel plan --dry-run`, the
    world-size benchmarks): build the model under `torch.device("meta")`, then
    `parallelize`, `build_optimizer` and a step run as they would on rank `rank`, with no
    data. Tear it down with `destroy()` before the next (one process group per process).

    The backend's name is "fake": the comm layer takes the code paths it takes on NCCL (no
    pairwise reduce-scatter or all-gather: those are gloo's, `Comm.pairwise`), so a dry run
    follows what a GPU job runs. No watchdog, no store other than torch's FakeStore.
    """
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"init_fake: world_size={world_size!r} must be an integer >= 1")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"init_fake: rank={rank!r} must be in 0..{world_size - 1}")
    if dist.is_initialized():
        raise RuntimeError("init_fake: a process group exists; call dataparallel.destroy() first")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    PROGRESS.reset()
    group = dist.group.WORLD
    return World(
        rank=rank,
        world_size=world_size,
        local_rank=0,
        device=torch.device("meta"),
        backend="fake",
        group=group,
    )


def regroup(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta, world: World
) -> World:
    """Leave the current process group and form a new default one (gloo) of `world_size`
    ranks that meet in `store` (a live run's next generation: train/live/recovery.py, [Note: quorum
    keys] in train/live/quorum.py); return `world` with the new rank, size and group.

    A collective of the new group that waits longer than `timeout` raises (no watchdog: a
    live run drops a stalled rank instead of ending). Nothing may still use the old group:
    parallelized models move with `dataparallel.rebind(model, world.group)`.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    PROGRESS.reset()
    dist.init_process_group(
        backend="gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    group = dist.group.WORLD
    return dataclasses.replace(
        world, rank=rank, world_size=world_size, group=group, backend=dist.get_backend(group)
    )


def launcher_settings(
    collective_timeout: float | None, check_collectives: bool | None
) -> tuple[float, bool]:
    """The arguments given, or else what the launcher put in the environment ([Note: launcher
    settings]), or else off."""
    if collective_timeout is None:
        text = os.environ.get(ENV_COLLECTIVE_TIMEOUT, "0")
        try:
            collective_timeout = float(text)
        except ValueError:
            raise ValueError(
                f"init: {ENV_COLLECTIVE_TIMEOUT}={text!r} is not a number of seconds"
            ) from None
    if check_collectives is None:
        check_collectives = os.environ.get(ENV_CHECK_COLLECTIVES, "0") == "1"
    return collective_timeout, check_collectives


def destroy() -> None:
    """Tear down the default process group (safe to call when none exists).

    Drop parallelized models and their optimizers first (`del model, optimizer`): they hold the
    group, and a group destroyed later, during the interpreter's exit, can abort the process.
    """
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    if dist.is_initialized():
        dist.destroy_process_group()
    PROGRESS.reset()
    PROGRESS.check = False


def _start_watchdog(rank: int, world_size: int, timeout_s: float) -> None:
    """Start this process's watchdog (replacing one started before); none alone or at 0 s."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    if timeout_s <= 0 or world_size == 1:
        return
    # Keys of a restarted attempt must not meet the last attempt's reports: attempt_store's
    # prefix already sees to it under torchrun's agent store; this one, under other set-ups.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = default_store()
    prefix = f"dataparallel/watchdog/{attempt}"
    _watchdog = Watchdog(store, rank, world_size, timeout_s, prefix=prefix).start()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it; bound and released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

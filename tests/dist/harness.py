"""Spawn a real world of N ranks (gloo on 127.0.0.1) once and run a function in every rank.

`run_world(n, fn, *args)` starts n processes, each of which calls `dataparallel.init()` from
torchrun-style environment variables and then `fn(world, *args)`; it returns the list of the
ranks' return values, in rank order. A rank that raises makes `run_world` raise with that
rank's traceback; a world that does not finish within `timeout` seconds is killed and the call
raises, so a hang in the code under test fails the test instead of stalling the suite.

The ranks are forked from a server process that has imported torch and dataparallel once
(multiprocessing's "forkserver", started on the first call; the suite's one server, shared with
the e2e tests' commands: tests/warm_processes.py): a world of fresh interpreters ("spawn") took
about 2 s to start, a forked one 0.1 s. The server has started no threads and run no
collective, so each rank begins as a fresh one would; it keeps the environment of the suite at
its start (a test that needs other variables in its ranks sets them in `fn`). Rank 0 hosts the
store, so it leaves last: it waits until every rank has ended `fn` (`_leave_together`).
"""

from __future__ import annotations

import os
import socket
import time
import traceback

from warm_processes import CONTEXT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    import dataparallel as dp

    try:
        world = dp.init()
        queue.put((rank, "ok", fn(world, *args)))
    except BaseException:  # report everything, including our own clear errors
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        _leave_together(rank, world_size)
        dp.destroy()


def _leave_together(rank: int, world_size: int, wait: float = 60.0) -> None:
    """Rank 0 hosts the store (no torchrun agent here): it waits, at most `wait` seconds, until
    every rank has marked the end of `fn`, so a rank still making a group or reading the store
    (a mesh's groups after the others' last collective) does not find it closed under it."""
    import torch.distributed as dist

    from dataparallel.torch_internals import default_store

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    if dist.get_world_size() != world_size:  # fn made another world of its own
        return
    try:
        store = default_store()
        store.add("harness/left", 1)
        deadline = time.monotonic() + wait
        while rank == 0 and store.add("harness/left", 0) < world_size:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
    except Exception:  # a store already gone: the rank's own report says why
        return


def run_world(world_size: int, fn, *args, timeout: float = 180.0) -> list:
    ctx = CONTEXT
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    except Exception as exc:  # queue.Empty: some rank hung
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout}s") from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RankError(errors)
    return [results[r][1] for r in range(world_size)]


class RankError(Exception):
    """One or more ranks raised; `.errors` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(text)

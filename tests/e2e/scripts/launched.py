"""A user's training script, run by tests/e2e/test_launch.py under `dataparallel launch`.

    python launched.py OUT_DIR [--crash-rank R] [--hang-rank R] [--stop-rank R]

Each rank takes its half of a fixed batch, makes one DDP step of SGD on a linear model and
writes OUT_DIR/rank<R>.json: what it saw of the launcher (rank, world size, threads, attempt,
the watchdog's timeout) and the weights after the step. --crash-rank R: rank R dies on the
first attempt, after the others wrote a "checkpoint"; a restarted attempt reads it (resumes).
--hang-rank R: rank R never reaches the step's all-reduce (the watchdog must stop the run).
--stop-rank R: rank R stops itself (SIGSTOP) before the step; nothing continues it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import time
from pathlib import Path

import torch

import dataparallel as dp
from dataparallel import runtime


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def reference_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--stop-rank", type=int, default=-1)
    args = parser.parse_args()
    out = Path(args.out)
    world = dp.init()
    checkpoint = out / "checkpoint.json"
    resumed_from = json.loads(checkpoint.read_text())["step"] if world.attempt else None
    if world.rank == args.crash_rank and world.attempt == 0:
        deadline = time.monotonic() + 60  # let rank 0 write the checkpoint (a busy machine
        while not checkpoint.exists() and time.monotonic() < deadline:  # may take a while)
            time.sleep(0.05)
        raise SystemExit("crashing on purpose")
    if world.rank == 0 and world.attempt == 0:
        checkpoint.write_text(json.dumps({"step": 7}))
    if world.rank == args.hang_rank:
        time.sleep(600)
    if world.rank == args.stop_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    model = dp.parallelize(reference_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = batch()
    share = len(inputs) // world.world_size
    mine = slice(world.rank * share, (world.rank + 1) * share)
    torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
    optimizer.step()
    watchdog = runtime._watchdog
    result = {
        "rank": world.rank,
        "world_size": world.world_size,
        "local_rank": world.local_rank,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "attempt": world.attempt,
        "resumed_from": resumed_from,
        "collective_timeout": watchdog.timeout_s if watchdog else 0,
        "weights": {k: v.tolist() for k, v in dp.full_state_dict(model).items()},
    }
    (out / f"rank{world.rank}.json").write_text(json.dumps(result))
    # [Note: teardown] in train/worker.py: the model and optimizer (which hold the process
    # group through the strategy) go before the group, or the exit may abort.
    del model, optimizer, result
    gc.collect()
    dp.destroy()


if __name__ == "__main__":
    main()

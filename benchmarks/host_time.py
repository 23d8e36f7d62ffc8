"""The engine's host time per parameter and its exposed communication, ours beside PyTorch's.

    python benchmarks/host_time.py                           # gpt-deep-narrow, 2 ranks, CPU
    python benchmarks/host_time.py --model gpt-small --steps 10
    PYTHONPATH=src python3 benchmarks/gpu_check.py           # the same table on one CUDA GPU

For each contender (default: bound, ddp, zero1, zero2, zero3, torch-ddp, fsdp2) and each step,
alternating between the contenders step by step after a barrier:
- step: the wall time of zero_grad, forward, backward, the optimizer step and what the step left
  in flight (on CUDA up to a device synchronize);
- host: the training thread's CPU in that step (`time.thread_time`): the Python and the dispatch
  of every operation, the engine's hooks and bookkeeping, and on CPU the arithmetic itself;
- host over the bound, per parameter tensor: (host - the bound's host) / the model's parameter
  tensors, in microseconds: what the engine's own work costs per parameter per step (292 tensors
  on gpt-deep-narrow);
- waiting: step - host, the time the training thread did not run (waiting for a collective, for
  the other rank, or for the GPU); over the bound's waiting it is the step's exposed
  communication (on one GPU with one rank: what of the GPU's work the host did not hide).
Each figure is the median over `--steps` steps, then the mean over the ranks.

The bound and PyTorch's peers are contenders.py's; `measure` also runs inside gpu_check.py's
one-rank NCCL world on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from contenders import CONTENDERS, MODELS, bench_model

import dataparallel as dp

DEFAULT = ("bound", "ddp", "zero1", "zero2", "zero3", "torch-ddp", "fsdp2")
COLUMNS = ("step", "host", "waiting")


def parameter_tensors(model_name: str) -> int:
    return sum(1 for _ in bench_model(model_name).parameters())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(prepared, x, y, world) -> dict[str, float]:
    _sync(world.device)
    dist.barrier(group=world.group)
    wall, thread = time.perf_counter(), time.thread_time()
    prepared.step(x, y)
    prepared.finish()
    host = time.thread_time() - thread
    _sync(world.device)
    step = time.perf_counter() - wall
    return {"step": step * 1e3, "host": host * 1e3, "waiting": (step - host) * 1e3}


def measure(world, model_name: str, names=DEFAULT, steps: int = 20, warmup: int = 3) -> dict:
    """{contender: {column: median ms}} on this rank; contenders that cannot be set up here are
    left out (the same on every rank)."""
    config = MODELS[model_name]
    generator = torch.Generator().manual_seed(1000 + world.rank)
    tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1), generator=generator)
    x, y = tokens[:, :-1].to(world.device), tokens[:, 1:].to(world.device)
    prepared = {}
    for name in names:
        torch.manual_seed(0)
        try:
            ready, error = CONTENDERS[name](bench_model(model_name).to(world.device), world), None
        except Exception as exc:  # noqa: BLE001 - reported, then left out on every rank alike
            ready, error = None, f"{type(exc).__name__}: {exc}"
        errors = [None] * world.world_size
        dist.all_gather_object(errors, error, group=world.group)
        if any(errors):
            if world.rank == 0:
                print(f"host_time: left out {name}: {next(e for e in errors if e)}", flush=True)
            continue
        prepared[name] = ready
    samples = {name: [] for name in prepared}
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + steps):
            for name, ready in prepared.items():
                sample = _timed(ready, x, y, world)
                if i >= warmup:
                    samples[name].append(sample)
    finally:
        gc.enable()
    return {
        name: {c: statistics.median(s[c] for s in rows) for c in COLUMNS}
        for name, rows in samples.items()
    }


def table(per_rank: list[dict], tensors: int) -> list[dict]:
    """Rows: the ranks' mean of each median, and the figures over the bound."""
    rows, names = [], list(per_rank[0])
    mean = {n: {c: statistics.fmean(r[n][c] for r in per_rank) for c in COLUMNS} for n in names}
    bound = mean.get("bound")
    for name in names:
        row = {"contender": name, **{f"{c}_ms": round(mean[name][c], 3) for c in COLUMNS}}
        if bound is not None:
            row["host_us_per_param"] = round(
                (mean[name]["host"] - bound["host"]) * 1e3 / tensors, 2
            )
            row["exposed_ms"] = round(mean[name]["waiting"] - bound["waiting"], 3)
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| contender | step ms | host ms | host over bound, us per parameter | waiting ms "
        "| exposed (waiting over bound) ms |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{r.get('host_us_per_param', float('nan')):+.2f} | {r['waiting_ms']:.2f} | "
            f"{r.get('exposed_ms', float('nan')):+.2f} |"
        )
    return "\n".join(lines)


def _rank(rank: int, args, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.nproc),
    )  # fmt: skip
    world = dp.init(backend="gloo", threads=1)
    medians = measure(world, args.model, args.contenders, args.steps, args.warmup)
    everyone = [None] * world.world_size
    dist.all_gather_object(everyone, medians, group=world.group)
    if rank == 0:
        queue.put(everyone)
    dist.barrier(group=world.group)
    dp.destroy()
    sys.stdout.flush()
    os._exit(0)  # [Note: teardown] in bench_step.py


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-deep-narrow", choices=sorted(MODELS))
    parser.add_argument("--contenders", default=",".join(DEFAULT))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    args.contenders = args.contenders.split(",")
    unknown = [n for n in args.contenders if n not in CONTENDERS]
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {sorted(CONTENDERS)}")
    from bench_step import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(args, free_port(), queue), nprocs=args.nproc)
    rows = table(queue.get(), parameter_tensors(args.model))
    print(f"- command: `python benchmarks/host_time.py {' '.join(sys.argv[1:])}`")
    print(
        f"- torch {torch.__version__}, {args.nproc} ranks x 1 thread, gloo; medians of "
        f"{args.steps} steps, alternating step by step, mean over ranks; "
        f"{parameter_tensors(args.model)} parameter tensors"
    )
    print(render(rows))


if __name__ == "__main__":
    main()

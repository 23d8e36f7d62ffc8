"""Where a training step's time goes, phase by phase, per rank: ours beside the bound and peers.

    python benchmarks/bench_phases.py --model gpt-small --contenders bound,ddp,torch-ddp

For each contender built on the plain loop (zero_grad, forward, backward, step; DeepSpeed's
engine is not) and each rank: the training thread's CPU per phase (`time.thread_time`), the
whole process' CPU (the backend's communication threads included) and the wall time of the
step, medians over `--steps` steps that alternate between the contenders. On a machine whose
cores are all busy computing, the difference in process CPU from the bound is the floor that
communication and bookkeeping add to a step; wall minus process CPU is time no thread of the
process ran (waiting for the other rank, or for the network). Set-up and method as
bench_step.py (same contenders, same world of `--nproc` ranks with one thread each).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_step import (
    add_world_args,
    check_world_args,
    free_port,
    join_world,
    make_batches,
    setup_everywhere,
)
from contenders import MODELS

import dataparallel as dp

PHASES = ("zero_grad", "forward", "backward", "step")
COLUMNS = (*PHASES, "finish", "thread", "process", "wall")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_world_args(parser, contenders="bound,ddp,torch-ddp", steps=20)
    args = parser.parse_args(argv)
    check_world_args(parser, args)
    return args


def phased_step(prepared, x, y, group) -> dict[str, float]:
    """One step after a barrier, in milliseconds: thread CPU per phase, process CPU, wall."""
    dist.barrier(group=group)
    marks: list[float] = []
    wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
    prepared.step(x, y, mark=lambda phase: marks.append(time.thread_time()))
    prepared.finish()  # what the step left in flight (an overlapped all-gather), timed here
    marks.append(time.thread_time())
    out, previous = {}, thread
    for name, mark in zip((*PHASES, "finish"), marks, strict=True):
        out[name], previous = (mark - previous) * 1e3, mark
    out["thread"] = (marks[-1] - thread) * 1e3
    out["process"] = (time.process_time() - process) * 1e3
    out["wall"] = (time.perf_counter() - wall) * 1e3
    return out


def run_rank(rank: int, args, port: int, queue) -> None:
    world = join_world(rank, args, port)
    batches = make_batches(args, MODELS[args.model].vocab_size, rank)
    prepared = {}
    for name in args.contenders:
        ready, error = setup_everywhere(name, args, world)
        if error or "mark" not in inspect.signature(ready.step).parameters:
            if rank == 0:
                print(f"skipped {name}: {error or 'not built on the plain loop'}", flush=True)
            continue
        prepared[name] = ready
    times = {name: [] for name in prepared}
    gc.collect()
    gc.disable()
    for i in range(args.warmup + args.steps):
        for name in prepared:  # alternate step by step, as bench_step's default
            sample = phased_step(prepared[name], *batches[i % len(batches)], world.group)
            if i >= args.warmup:
                times[name].append(sample)
    gc.enable()
    medians = {
        name: {c: statistics.median(s[c] for s in samples) for c in COLUMNS}
        for name, samples in times.items()
    }
    everyone = [None] * world.world_size
    dist.all_gather_object(everyone, medians, group=world.group)
    if rank == 0:
        queue.put(everyone)
    dist.barrier(group=world.group)
    dp.destroy()
    sys.stdout.flush()
    os._exit(0)  # [Note: teardown] in bench_step.py


def render(per_rank: list[dict], args) -> str:
    lines = [
        f"- command: `python benchmarks/bench_phases.py {' '.join(sys.argv[1:])}`",
        f"- torch {torch.__version__}; medians of {args.steps} steps per contender and rank, "
        "alternating step by step; milliseconds",
        "",
        "| contender | rank | " + " | ".join(COLUMNS) + " | process - bound |",
        "|---|--:|" + "--:|" * (len(COLUMNS) + 1),
    ]
    for name in per_rank[0]:
        for rank, medians in enumerate(per_rank):
            row = medians[name]
            bound = medians.get("bound", {}).get("process")
            extra = f"{row['process'] - bound:+.1f}" if bound is not None else ""
            cells = " | ".join(f"{row[c]:.1f}" for c in COLUMNS)
            lines.append(f"| {name} | {rank} | {cells} | {extra} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.warmup = max(args.warmup, 1)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(run_rank, args=(args, free_port(), queue), nprocs=args.nproc)
    print(render(queue.get(), args))


if __name__ == "__main__":
    main()

"""Side-by-side training step time: our strategies, their PyTorch/DeepSpeed peers, the bound.

    python benchmarks/bench_step.py --model gpt-small --contenders ddp,torch-ddp,bound \
        --rounds 7 --steps 10 --warmup 3 --nproc 2
    python benchmarks/bench_step.py --model gpt-small            # every available contender
    python benchmarks/bench_step.py --model gpt-medium --json medium.json
    python benchmarks/bench_step.py --baseline HEAD~1 --contenders ddp,old-ddp,zero2,old-zero2,bound

One invocation starts `--nproc` ranks (gloo on 127.0.0.1, one thread each) and, inside that
one world, runs the contenders interleaved: round 1 runs A, B, C, round 2 runs B, C, A, and so
on, each for `--warmup` untimed then `--steps` timed steps on a freshly built model. Machine
drift (other jobs, frequency, caches) then lands on every contender alike. See README.md here
for the method and how to read the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
import warnings

import baseline
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from contenders import (
    CONTENDERS,
    MODELS,
    OLD_IN_ALL,
    OURS,
    PEERS,
    bench_model,
    old_contenders,
    unavailable,
)
from step_report import machine_info, render
from step_stats import finish_flags, summarize

import dataparallel as dp


def add_world_args(parser: argparse.ArgumentParser, contenders: str, steps: int) -> None:
    """The options every benchmark here shares: model, contenders, steps, ranks, batch."""
    parser.add_argument("--model", default="gpt-small", choices=list(MODELS))
    parser.add_argument(
        "--contenders",
        default=contenders,
        help=f"comma-separated, or 'all' (unavailable ones are skipped): {', '.join(CONTENDERS)}"
        ", and with --baseline old-<name> for any of ours",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="a git commit (HEAD~1, a hash) whose package runs the old-* contenders",
    )
    parser.add_argument(
        "--steps", type=int, default=steps, help="timed steps per contender (per round)"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per contender (per round)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one thread each)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument(
        "--seq", type=int, help="tokens per sequence (default: the model's, at most 256)"
    )
    parser.add_argument("--seed", type=int, default=0)


def check_world_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad shared options with one line each; turn --contenders into a list.

    With --baseline, check out and import the old package here, once, so that a bad ref or an
    old package that does not import fails in one line before any rank starts.
    """
    if args.contenders == "all":
        names = list(CONTENDERS) + list(OLD_IN_ALL if args.baseline else ())
    else:
        names = args.contenders.split(",")
    old = [f"old-{n}" for n in OURS]
    unknown = [n for n in names if n not in CONTENDERS and n not in old]
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}, old-*")
    if any(n in old for n in names) and not args.baseline:
        parser.error("old-* contenders need --baseline REF (the commit to compare with)")
    block_size = MODELS[args.model].block_size
    args.seq = min(256, block_size) if args.seq is None else args.seq
    if min(args.steps, args.nproc, args.batch, args.seq) < 1 or args.warmup < 0:
        parser.error("--steps, --nproc, --batch and --seq must be >= 1, --warmup >= 0")
    if args.seq > block_size:
        parser.error(f"--seq {args.seq} exceeds {args.model}'s block_size {block_size}")
    args.contenders = names
    args.baseline_commit = args.baseline_path = None
    if args.baseline:
        try:
            args.baseline_commit = baseline.resolve(args.baseline)
            args.baseline_path = str(baseline.checkout(args.baseline))
            baseline.load(args.baseline_path)
        except baseline.BaselineError as exc:
            parser.error(str(exc))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_world_args(parser, contenders="all", steps=10)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument(
        "--interleave",
        choices=("step", "round"),
        default="step",
        help="alternate the contenders step by step (default) or run each one's steps in a row",
    )
    parser.add_argument("--json", help="also write the raw numbers to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    check_world_args(parser, args)
    return args


# -- inside each rank -------------------------------------------------------------------------
def make_batches(args, vocab_size: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token batches, this rank's own, the same for every contender and round."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, vocab_size, (args.batch, args.seq + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def timed_step(prepared, x, y, timing_group, finish: bool) -> tuple[float, float, torch.Tensor]:
    """One step after a barrier: (wall seconds, process CPU seconds, loss) on this rank.

    The barrier makes every rank start together, so a step's time is that of the rank that
    finished last (max across ranks, taken at the end of the round), as a synchronous job sees
    it. CPU time is the whole process' (the backend's threads included): the work done, which
    other jobs on the machine disturb less than the wall time. `finish`: the step's work still
    in flight is waited for inside the timing (before another contender runs), so an overlapped
    all-gather gains only where the same contender's next step follows (`--interleave round`).
    The barrier runs on a group of its own: on the training group gloo's barrier would first
    wait out the work still in flight there, finishing it before the clock starts.
    """
    dist.barrier(group=timing_group)
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = prepared.step(x, y)
    if finish:
        prepared.finish()
    return time.perf_counter() - start, time.process_time() - start_cpu, loss


def run_round(names: list[str], prepared: dict, batches, args, timing_group) -> dict:
    """Every batch through every contender; {name: (walls, cpus, last loss)} of timed steps.

    `--interleave step` alternates the contenders step by step (the order rotating each step),
    `round` runs each one's steps back to back. The garbage collector is off while timing, so
    that a collection pause cannot land on one contender only.
    """
    if args.interleave == "step":
        rotated = [names[i % len(names) :] + names[: i % len(names)] for i in range(len(batches))]
        order = [(i, name) for i in range(len(batches)) for name in rotated[i]]
    else:
        order = [(i, name) for name in names for i in range(len(batches))]
    walls, cpus = {n: [] for n in names}, {n: [] for n in names}
    losses = {n: torch.zeros(()) for n in names}
    gc.collect()
    gc.disable()
    try:
        for (i, name), finish in zip(order, finish_flags(order), strict=True):
            wall, cpu, losses[name] = timed_step(prepared[name], *batches[i], timing_group, finish)
            if i >= args.warmup:
                walls[name].append(wall)
                cpus[name].append(cpu)
    finally:
        gc.enable()
    result = {}
    for name in names:
        slowest = torch.tensor([walls[name], cpus[name]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=timing_group)
        result[name] = (*slowest.tolist(), float(losses[name]))
    return result


def setup_everywhere(name: str, args, world):
    """Build the model and set contender `name` up; (prepared, None) or (None, error) on all ranks.

    A setup that fails the same way on every rank (an unsupported feature, say) is reported
    and the contender dropped, instead of ending the run.
    """
    torch.manual_seed(args.seed)
    model = bench_model(args.model)
    try:
        prepared, error = CONTENDERS[name](model, world), None
    except Exception as exc:  # reported, then skipped on every rank alike
        prepared, error = None, f"{type(exc).__name__}: {exc}"
    errors = [None] * world.world_size
    dist.all_gather_object(errors, error, group=world.group)
    first = next((e for e in errors if e), None)
    return (None, first) if first else (prepared, None)


def join_world(rank: int, args, port: int):
    """This process as rank `rank` of the `--nproc` world on 127.0.0.1, one thread each."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.nproc),
    )
    # DeepSpeed (and our comm layer) call collectives that torch 2.13 deprecates, with a
    # warning at every call: keep the output readable.
    warnings.filterwarnings(
        "ignore", message=r".* is deprecated\. Please use", category=FutureWarning
    )
    world = dp.init(backend="gloo", threads=1)
    if args.baseline_path:
        # The old package shares this process' default group; its old-* contenders join the
        # registry that setup_everywhere reads.
        CONTENDERS.update(old_contenders(baseline.load(args.baseline_path)))
    return world


def run_rank(rank: int, args, port: int, out_path: str) -> None:
    """One rank: every round runs every contender in a rotated order; rank 0 saves results."""
    world = join_world(rank, args, port)
    batches = make_batches(args, MODELS[args.model].vocab_size, rank)
    names = list(args.contenders)
    timing_group = dist.new_group(backend="gloo")  # barriers only: see timed_step
    results = {n: {"times": [], "cpu_times": [], "memory": {}, "loss": None} for n in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        prepared = {}
        for name in names[shift:] + names[:shift]:
            if results[name].get("error"):
                continue
            prepared[name], error = setup_everywhere(name, args, world)
            if error:
                results[name]["error"] = error
                del prepared[name]
        timed = run_round(list(prepared), prepared, batches, args, timing_group)
        for name, (wall, cpu, loss) in timed.items():
            results[name].update(memory=prepared[name].memory(), loss=loss)
            results[name]["times"] += wall
            results[name]["cpu_times"] += cpu
        del prepared
    memories = [None] * world.world_size
    dist.all_gather_object(memories, {n: r["memory"] for n, r in results.items()}, world.group)
    if rank == 0:
        for name in names:
            results[name]["memory_per_rank"] = [m[name] for m in memories]
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier(group=world.group)
    dp.destroy()
    # [Note: teardown] About one run in fifteen, a rank aborted *after* this point, in the
    # interpreter's exit ("terminate called without an active exception", no Python frame:
    # a C++ static destructor racing a thread), which made mp.spawn fail a finished run. The
    # results are on disk and the group is gone, so leave without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- in the launching process -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    skipped = {n: why for n in args.contenders if (why := unavailable(n))}
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", file=sys.stderr)
    args.contenders = [n for n in args.contenders if n not in skipped]
    if not args.contenders:
        sys.exit("bench_step: no contender can run here")
    meta = machine_info()
    # Set before the ranks start, so that their torch reads it at import.
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.spawn(run_rank, args=(args, free_port(), out_path), nprocs=args.nproc, join=True)
        with open(out_path) as f:
            results = json.load(f)
    meta["load_average_end"] = os.getloadavg()
    skipped |= {n: f"setup failed: {r['error']}" for n, r in results.items() if r.get("error")}
    summary = summarize(results, args, PEERS)
    print(render(meta, summary, skipped, args))
    if args.json:
        with open(args.json, "w") as f:
            raw = {"meta": meta, "args": vars(args), "skipped": skipped, "raw": results}
            json.dump({**raw, **summary}, f, indent=1)


if __name__ == "__main__":
    main()

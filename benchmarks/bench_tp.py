"""Data parallelism over a tensor-parallel GPT: ours against FSDP2 on the same split, and the
planner's prediction (issue 21; docs/core.md, "Hybrid parallelism").

    python benchmarks/bench_tp.py --model gpt-small --nproc 4 --tp 2 --rounds 3
    python benchmarks/bench_tp.py --model gpt-small --nproc 2 --tp 2 --contenders ddp,zero2,zero3

One world of `--nproc` ranks (gloo, one thread each) as dp x tp; the GPT is split over "tp" as
`dataparallel train --tp` splits it (the GPT's `tensor_parallel_plan`). Contenders: ours
(`dp.compose(model, dp.Recipe(strategy=..., tp=T), mesh=mesh)`: the split, then the strategy
over mesh["dp"]) and fsdp2 (`fully_shard` on each block,
then the root, on mesh["dp"], its documented use over tensor parallelism). Each round builds
every contender afresh and runs `--warmup` untimed then `--steps` timed steps, the contenders
in a rotated order per round (bench_step.py's interleaving); a step's time is its slowest
rank's; the table gives the median over rounds of each round's median. The "tp" peers read
the same batch, the dp ranks different ones. Memory: bytes held between steps per rank
(parameters, gradients, optimizer state: `dp.memory_report`, FSDP2's local tensors), the
largest rank's. The planner's columns are `dp.plan(model, ranks, tp=...)` with this machine's
profile (src/dataparallel/plan/cpu-2core.json: 2 ranks on 2 cores, so step times are
comparable only when --nproc is 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from contenders import MODELS, adamw, bench_model, held_bytes, plain_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import dataparallel as dp

PROFILE = Path(__file__).resolve().parent.parent / "src/dataparallel/plan/cpu-2core.json"


def ours(strategy: str):
    def setup(model, mesh):
        recipe = dp.Recipe(strategy=strategy, tp=mesh["tp"].size())
        optimizer = dp.compose(model, recipe, torch.optim.AdamW, mesh=mesh, lr=3e-4).optimizer
        return plain_step(model, optimizer), lambda: dp.memory_report(model, optimizer)

    return setup


def fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    parallelize_module(model, mesh["tp"], model.tensor_parallel_plan(mesh["tp"].size()))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = adamw(model.parameters())
    return plain_step(model, optimizer), lambda: held_bytes(model.parameters(), optimizer)


CONTENDERS = {"ddp": ours("ddp"), "zero2": ours("zero2"), "zero3": ours("zero3"), "fsdp2": fsdp2}


def run_rank(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc))  # fmt: skip
    dp.init(backend="gloo", threads=1)
    mesh = init_device_mesh("cpu", (args.nproc // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(1000 + rank // args.tp)  # tp peers: the same batch
    seq = min(MODELS[args.model].block_size, 256)
    data = torch.randint(0, 256, (args.warmup + args.steps, args.batch, seq + 1), generator=gen)
    names = args.contenders
    times = {n: [] for n in names}
    memory = {}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            torch.manual_seed(0)
            step, report = CONTENDERS[name](bench_model(args.model), mesh)
            gc.collect()
            gc.disable()
            steps = []
            for i, batch in enumerate(data):
                dist.barrier()
                start = time.perf_counter()
                step(batch[:, :-1], batch[:, 1:])
                if i >= args.warmup:
                    steps.append(time.perf_counter() - start)
            gc.enable()
            t = torch.tensor(steps, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each step: its slowest rank
            times[name].append(statistics.median(t.tolist()))
            held = report()
            total = torch.tensor([float(held["params"] + held["grads"] + held["optimizer_state"])])
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            memory[name] = float(total)
            del step, report
            gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "memory": memory}))
    dist.barrier()
    dp.destroy()
    sys.stdout.flush()
    os._exit(0)  # [Note: teardown] in bench_step.py


def table(args, measured: dict) -> str:
    seq = min(MODELS[args.model].block_size, 256)
    lines = [
        f"{args.model}, {args.nproc} ranks = dp {args.nproc // args.tp} x tp {args.tp}, "
        f"{args.batch} x {seq} tokens per dp rank, fp32 AdamW, {args.rounds} rounds x "
        f"{args.steps} steps",
        "",
        "| contender | step ms (median of rounds) | rounds | held MB per rank | planned held MB "
        "| planned step ms |",
        "|---|--:|---|--:|--:|--:|",
    ]
    for name in args.contenders:
        t = measured["times"][name]
        held = measured["memory"][name] / 1e6
        planned = ["", ""]
        if name != "fsdp2":
            row = dp.plan(args.model, ranks=args.nproc, tp=args.tp, hardware=str(PROFILE),
                          micro_batch=args.batch, strategies=[name],
                          shard_sizes=[args.nproc // args.tp]).rows[0]  # fmt: skip
            planned = [f"{row.held_bytes / 1e6:.2f}", f"{row.step_s * 1e3:.0f}"]
        rounds = " ".join(f"{x * 1e3:.0f}" for x in t)
        lines.append(f"| {name} | {statistics.median(t) * 1e3:.0f} | {rounds} | {held:.2f} | "
                     f"{planned[0]} | {planned[1]} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-small", choices=list(MODELS))
    parser.add_argument("--contenders", default="ddp,zero2,zero3,fsdp2")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    args.contenders = args.contenders.split(",")
    unknown = [n for n in args.contenders if n not in CONTENDERS]
    if unknown or args.nproc % args.tp:
        parser.error(f"unknown contenders {unknown}" if unknown else "--tp must divide --nproc")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(run_rank, args=(args, dp.free_port(), out), nprocs=args.nproc, join=True)
        measured = json.loads(Path(out).read_text())
    print(table(args, measured))
    print(json.dumps(measured))


if __name__ == "__main__":
    main()

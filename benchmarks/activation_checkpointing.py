"""Activation checkpointing (`dp.checkpoint_activations`, the job's --activation-checkpointing)
against the planner's prediction of it: memory and step time, with and without, on 2 ranks.

    flock /tmp/dp-heavy.lock python benchmarks/activation_checkpointing.py

Per model and strategy, on 2 ranks (gloo, one thread each), the method of plan_validate.py:
- peak: the CPU allocator's events (`torch.profiler`, `profile_memory`) from before the model
  is built, the highest running total of allocated minus freed bytes during the second step
  (which starts at a `record_function` mark, in the profiler's own clock), max over the ranks;
  held: parameters, gradients and optimizer state after it (`dp.memory_report`). Each form in
  a world of its own: measured after another model in the same processes, ZeRO-3 with
  checkpointing read 13.2 MB (gpt-small's whole parameters) higher than alone;
- step: without and with checkpointing interleaved step by step in one world, median of each
  step's slowest rank.
Predicted: `dp.plan(model, ranks=2, hardware=<plan/cpu-2core.json>, activation_checkpointing=)`
(the planner keeps each block's input plus one block's activations, and counts 4/3 of the
compute). Prints a Markdown table and the measurements as JSON.
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
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from contenders import bench_model, ours  # noqa: E402
from plan_validate import BATCH, PROFILE, batches  # noqa: E402

import dataparallel as dp  # noqa: E402

FORMS = ("off", "on")
SECOND = "activation_checkpointing:second_step"


def prepare(name: str, strategy: str, form: str, world):
    torch.manual_seed(0)
    model = bench_model(name)
    if form == "on":
        dp.checkpoint_activations(model)
    return ours(strategy)(model, world)


def measure_memory(name: str, strategy: str, form: str, world, data) -> dict:
    """Held bytes after two steps and the allocator's peak in the second (plan_validate's)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prepared = prepare(name, strategy, form, world)
        prepared.step(*data[0])
        dist.barrier()
        with torch.profiler.record_function(SECOND):
            pass
        prepared.step(*data[1])
        report = prepared.memory()
    events = prof.profiler.kineto_results.events()
    second = min(e.start_ns() for e in events if e.name() == SECOND)
    running, peak = 0, 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        running += e.nbytes()
        if e.start_ns() >= second:
            peak = max(peak, running)
    del prepared
    gc.collect()
    return {"held": report["params"] + report["grads"] + report["optimizer_state"], "peak": peak}


def time_steps(name: str, strategy: str, world, data, warmup: int) -> dict:
    """Without and with checkpointing, interleaved step by step: the median slowest rank."""
    prepared = {form: prepare(name, strategy, form, world) for form in FORMS}
    times = {form: [] for form in FORMS}
    gc.disable()
    for i, (x, y) in enumerate(data):
        for form in FORMS if i % 2 == 0 else FORMS[::-1]:
            dist.barrier()
            begin = time.perf_counter()
            prepared[form].step(x, y)
            prepared[form].finish()
            if i >= warmup:
                times[form].append(time.perf_counter() - begin)
    gc.enable()
    out = {}
    for form in FORMS:
        t = torch.tensor(times[form], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[form] = statistics.median(t.tolist())
    return out


def rank_main(rank, port, name, strategy, form, steps, path) -> None:
    """One world: the memory of `form` ("off" / "on"), or the interleaved times ("times")."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")  # fmt: skip
    world = dp.init(backend="gloo", threads=1)
    data = batches(name, BATCH[name], steps + 2, rank)
    if form == "times":
        out = time_steps(name, strategy, world, data, warmup=2)
    else:
        gathered = [None] * world.world_size
        dist.all_gather_object(gathered, measure_memory(name, strategy, form, world, data))
        out = {k: max(g[k] for g in gathered) for k in ("held", "peak")}
    if rank == 0:
        Path(path).write_text(json.dumps(out))
    dist.barrier()
    dp.destroy()
    sys.stdout.flush()
    os._exit(0)  # [Note: teardown] in bench_step.py


def run_world(name: str, strategy: str, form: str, steps: int) -> dict:
    port = dp.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        args = (port, name, strategy, form, steps, path)
        mp.spawn(rank_main, args=args, nprocs=2, join=True)
        return json.loads(Path(path).read_text())


def run_model(name: str, strategies: list[str], steps: int) -> dict:
    return {
        s: {
            "memory": {form: run_world(name, s, form, steps) for form in FORMS},
            "times": run_world(name, s, "times", steps),
        }
        for s in strategies
    }


def predicted(name: str, strategy: str, form: str):
    return dp.plan(name, ranks=2, hardware=str(PROFILE), micro_batch=BATCH[name],
                   strategies=[strategy], shard_sizes=[2],
                   activation_checkpointing=form == "on").rows[0]  # fmt: skip


def table(measured: dict) -> str:
    lines = [
        "| model | strategy | peak off: predicted / measured MB | peak on: predicted / measured "
        "MB | saved by it: predicted / measured MB | step on / off: predicted / measured |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for name, by_strategy in measured.items():
        for s, m in by_strategy.items():
            p = {form: predicted(name, s, form) for form in FORMS}
            peak = {form: m["memory"][form]["peak"] for form in FORMS}
            cells = [f"{p[f].peak_bytes / 1e6:.1f} / {peak[f] / 1e6:.1f}" for f in FORMS]
            saved_p = (p["off"].peak_bytes - p["on"].peak_bytes) / 1e6
            cells.append(f"{saved_p:.1f} / {(peak['off'] - peak['on']) / 1e6:.1f}")
            ratio_p = p["on"].step_s / p["off"].step_s
            ratio_m = m["times"]["on"] / m["times"]["off"]
            ms = f"{m['times']['off'] * 1e3:.0f} -> {m['times']['on'] * 1e3:.0f} ms"
            cells.append(f"{ratio_p:.2f}x / {ratio_m:.2f}x ({ms})")
            lines.append(f"| {name} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt-small,gpt-medium")
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per form")
    parser.add_argument("--measured", help="a JSON of measurements printed by a run: tabulate it")
    args = parser.parse_args()
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())
    else:
        strategies = args.strategies.split(",")
        measured = {n: run_model(n, strategies, args.steps) for n in args.models.split(",")}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"Measured {stamp}, torch {torch.__version__}.\n\n" + table(measured))
    print(json.dumps(measured))


if __name__ == "__main__":
    main()

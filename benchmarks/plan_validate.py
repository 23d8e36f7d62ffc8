"""The planner against measured runs: gpt-small and gpt-medium on 2 ranks, ddp and ZeRO-1/2/3.

    flock /tmp/dp-heavy.lock python benchmarks/plan_validate.py --write-docs

First calibrates this machine (`dataparallel plan --calibrate` for both models, written to
src/dataparallel/plan/cpu-2core.json), then per model starts 2 ranks (gloo, one thread each)
and, per strategy:
- memory: the run's own report (`dp.memory_report`: parameters, gradients, optimizer state
  held after a step) and its peak, from the CPU allocator's events (`torch.profiler` with
  `profile_memory`, started before the model is built, so every block the rank allocates is
  seen): the highest running total of allocated minus freed bytes during the second step;
- step time: the strategies' steps interleaved step by step (as bench_step.py does), median
  of each step's slowest rank.
Then prints (and with --write-docs puts into docs/plan.md) predicted against measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
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

import dataparallel as dp  # noqa: E402
from dataparallel.plan.calibrate import calibrate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "src/dataparallel/plan/cpu-2core.json"
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
BATCH = {"gpt-small": 4, "gpt-medium": 2}


def batches(name: str, batch: int, count: int, rank: int):
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(count):
        t = torch.randint(0, 256, (batch, 257), generator=gen)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def measure_memory(name: str, strategy: str, world, data) -> dict:
    """The run's memory report after two steps, and the allocator's peak in the second."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = bench_model(name)
        prepared = ours(strategy)(model, world)
        prepared.step(*data[0])
        dist.barrier()
        second = time.perf_counter_ns()
        prepared.step(*data[1])
        report = prepared.memory()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    start = prof.profiler.kineto_results.trace_start_ns()
    running, peak = 0, 0
    for e in events:
        running += e.nbytes()
        # Event times are relative to the trace start on some builds, absolute on others.
        t = e.start_ns() if e.start_ns() > second / 2 else e.start_ns() + start
        if t >= second:
            peak = max(peak, running)
    held = report["params"] + report["grads"] + report["optimizer_state"]
    del model, prepared
    gc.collect()
    return {"held": held, "peak": peak, "report": report}


def time_steps(name: str, world, data, warmup: int) -> dict:
    """Every strategy and the no-communication bound, interleaved step by step."""
    from contenders import bound

    names = [*STRATEGIES, "bound"]
    prepared = {}
    for s in names:
        torch.manual_seed(0)
        model = bench_model(name)
        prepared[s] = bound(model, world) if s == "bound" else ours(s)(model, world)
    times = {s: [] for s in names}
    gc.disable()
    for i, (x, y) in enumerate(data):
        for s in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            prepared[s].step(x, y)
            prepared[s].finish()
            if i >= warmup:
                times[s].append(time.perf_counter() - start)
    gc.enable()
    out = {}
    for s in names:
        t = torch.tensor(times[s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[s] = statistics.median(t.tolist())
    return out


def rank_main(rank: int, port: int, name: str, steps: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")  # fmt: skip
    world = dp.init(backend="gloo", threads=1)
    data = batches(name, BATCH[name], steps + 2, rank)
    memory = {s: measure_memory(name, s, world, data) for s in STRATEGIES}
    gathered = [None, None]
    dist.all_gather_object(gathered, memory)
    times = time_steps(name, world, data, warmup=2)
    if rank == 0:
        merged = {
            s: {k: max(g[s][k] for g in gathered) for k in ("held", "peak")} for s in STRATEGIES
        }
        Path(path).write_text(json.dumps({"memory": merged, "times": times}))
    dist.barrier()
    dp.destroy()
    sys.stdout.flush()
    os._exit(0)  # [Note: teardown] in bench_step.py


def run_model(name: str, steps: int) -> dict:
    port = dp.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        mp.spawn(rank_main, args=(port, name, steps, path), nprocs=2, join=True)
        return json.loads(Path(path).read_text())


def table(models: list[str], measured: dict) -> str:
    lines = [
        "| model | strategy | held: predicted / measured MB | error | peak: predicted / "
        "measured MB | error | step: predicted / measured ms | error |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for name in models:
        for s in STRATEGIES:
            p = dp.plan(name, ranks=2, hardware=str(PROFILE), micro_batch=BATCH[name],
                        strategies=[s], shard_sizes=[2]).rows[0]  # fmt: skip
            m, t = measured[name]["memory"][s], measured[name]["times"][s]
            cells = []
            for pred, meas in ((p.held_bytes, m["held"]), (p.peak_bytes, m["peak"])):
                cells.append(f"{pred / 1e6:.1f} / {meas / 1e6:.1f} | {pred / meas - 1:+.1%}")
            cells.append(f"{p.step_s * 1e3:.0f} / {t * 1e3:.0f} | {p.step_s / t - 1:+.1%}")
            lines.append(f"| {name} | {s} | " + " | ".join(cells) + " |")
    bounds = ", ".join(f"{n} {measured[n]['times']['bound'] * 1e3:.0f} ms" for n in models)
    lines.append("")
    lines.append(f"No-communication bound measured in the same runs: {bounds}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt-small,gpt-medium")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per strategy")
    parser.add_argument("--write-docs", action="store_true", help="update docs/plan.md")
    parser.add_argument("--no-calibrate", action="store_true", help="use the stored profile")
    parser.add_argument("--measured", help="a JSON of measurements printed by a run: tabulate it")
    args = parser.parse_args()
    models = args.models.split(",")
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())
    else:
        if not args.no_calibrate:
            calibrate(models, batch=4, out=str(PROFILE))
        measured = {name: run_model(name, args.steps) for name in models}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = f"Measured {stamp}, torch {torch.__version__}.\n\n" + table(models, measured)
    print(text)
    print(json.dumps(measured))
    if args.write_docs:
        doc = ROOT / "docs/plan.md"
        body = doc.read_text()
        body = re.sub(
            r"(<!-- validation:start -->\n).*?(\n<!-- validation:end -->)",
            lambda m: m.group(1) + text + m.group(2), body, flags=re.S,
        )  # fmt: skip
        doc.write_text(body)


if __name__ == "__main__":
    main()

"""The engine's cost as the world grows (issue 32, item 3): one table, worlds of 2 to 4,096.

    python benchmarks/world_cost.py                          # every row, the table of BENCHMARKS.md
    python benchmarks/world_cost.py --only quorum,layout     # some groups of rows
    python benchmarks/world_cost.py --worlds 2,8,64 --only engine

Each row is one piece of Python work a rank (or the decider, or a checkpoint's coordinator)
runs, timed at each world size in CPU seconds of this process (`time.process_time`, one torch
thread: a busy neighbour on a shared host slows the wall clock, not this), the median of
repeats. Nothing starts more than this one process:
- quorum: `decide` (train/live/membership.py) over reports from every slot of a run of 10 to
  10,000 replicas: a tenth behind, the rest at the newest step, a hundredth more joining.
- layout: the pure functions a rank runs in `parallelize`, for gpt-small's parameters, without
  a process group: the bucket plan (parts/buckets.py `plan_buckets`, padded to the world), the
  flat-shard geometry of one rank (parts/layout.py `ShardLayout` and parts/flat_shard.py
  `FlatShard` on every bucket), the whole-parameter owners (parts/owners.py `assign_owners`)
  and the holders each owner sends to (`ShardLayout.local_slice` over the ranks), ZeRO-3's
  unit plan (strategies/zero3/plan.py `plan_units`) and the planner (`dp.plan`, every strategy).
- checkpoint: ZeRO-1's sharded checkpoint of gpt-small under AdamW (each parameter's pieces,
  both moments, the `step` scalars) as checkpoint/dcp.py's `ChunkSavePlanner` builds it: one
  rank's local plan from its layout, and DCP's `create_global_plan` over every rank's plan
  (timed without a process group: what the coordinator runs).
- engine: `dp.parallelize`, `dp.build_optimizer` and one training step (AdamW, one sequence of
  16 tokens: the arithmetic is tiny, the engine's Python work shows) of gpt-small as rank 0 of
  PyTorch's fake process group (`init_process_group("fake", ...)`: collectives move no data,
  object collectives return this rank's own object from every rank), for DDP and ZeRO-1/2/3,
  the median of 3 fresh models and groups; `plain step` is the same step without the engine.
The last columns: the growth from 512 to 4,096 (x8 is linear; x1 is flat) and memory at the
largest size: tracemalloc's peak of Python allocations for pure rows, the bytes rank 0 holds
(`dp.memory_report`: parameters, gradients and optimizer state) for the engine's.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
import tracemalloc

import torch
import torch.distributed as dist

import dataparallel as dp
from dataparallel.checkpoint.dcp import Chunk, ChunkSavePlanner
from dataparallel.models import build_model
from dataparallel.strategies.parts.buckets import MB, plan_buckets
from dataparallel.strategies.parts.flat_shard import FlatShard
from dataparallel.strategies.parts.geometry import build_geometry
from dataparallel.strategies.parts.layout import ShardLayout
from dataparallel.strategies.parts.owners import assign_owners
from dataparallel.strategies.zero3.plan import plan_units
from dataparallel.train.live.membership import JOIN, Membership, QuorumPolicy, Report, decide

WORLDS = (2, 8, 64, 512, 1024, 4096)
REPLICAS = (10, 100, 1000, 10000)
GROUPS = ("quorum", "layout", "checkpoint", "engine")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MODEL = "gpt-small"


def cpu_seconds(fn, budget: float = 0.3, most: int = 25) -> float:
    """Median CPU seconds of `fn()` over repeats: at least 3, until `budget` s are spent."""
    fn()  # the first call's imports and caches are no cost of the world
    gc.collect()  # garbage of earlier rows is no cost of this one
    times = []
    while len(times) < 3 or (sum(times) < budget and len(times) < most):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def python_peak(fn) -> int:
    """Peak bytes of Python allocations while `fn()` runs (tracemalloc; not torch storage)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- the quorum ------------------------------------------------------------------------------
def quorum_case(replicas: int):
    """A generation of `replicas` members all reporting, a tenth one step behind, and a
    hundredth more replicas joining."""
    previous = Membership(generation=3, members=tuple(range(replicas)))
    reports = {r: Report(replica=r, step=99 if r % 10 == 0 else 100) for r in range(replicas)}
    for r in range(replicas, replicas + replicas // 100 + 1):
        reports[r] = Report(replica=r, step=0, where=JOIN)
    alive = set(range(replicas))
    return lambda: decide(previous, reports, alive, 0.0, QuorumPolicy())


# -- the layout ------------------------------------------------------------------------------
def model_params():
    """gpt-small on the meta device (shapes only) and its trainable parameters."""
    with torch.device("meta"):
        model = build_model(MODEL)
    return model, [p for p in model.parameters() if p.requires_grad]


def buckets_of(params, world: int) -> list[list]:
    """The parameters of each of ZeRO-1/2's buckets (backward order, padded to the world)."""
    backward = list(reversed(params))
    specs = plan_buckets([(p.numel(), p.dtype, "cpu") for p in backward], 25 * MB, pad_to=world)
    return [[backward[i] for i in spec.param_indices] for spec in specs]


def flat_shards(model, params, world: int, rank: int):
    """`rank`'s flat shard of every bucket, and the geometry the strategy exports from them."""
    sharded = []
    for members in buckets_of(params, world):
        layout = ShardLayout.pack([p.numel() for p in members], world)
        data = torch.empty(layout.shard_numel)
        sharded.append((FlatShard(layout, rank, data, [True] * len(members)), members))
    optimized = {id(piece) for shard, _ in sharded for piece in shard.params}
    return build_geometry(model, sharded, None, optimized)


def holders_plan(params, world: int) -> int:
    """What every rank walks to plan the owners' messages of a step: each holder's slice of
    each parameter (owners.py `Owners.send_values`, `_to_owners`)."""
    count = 0
    for members in buckets_of(params, world):
        sizes = [p.numel() for p in members]
        layout = ShardLayout.pack(sizes, world)
        for position in range(len(sizes)):
            for holder in layout.holders(position):
                start, stop, _ = layout.local_slice(position, holder)
                count += stop > start
    return count


def layout_rows(worlds) -> dict[str, dict[int, tuple]]:
    model, params = model_params()
    sizes = [p.numel() for p in params]
    rows = {
        "plan_buckets": lambda n: lambda: buckets_of(params, n),
        "flat shards + geometry (one rank)": lambda n: (
            lambda: flat_shards(model, params, n, n // 2)
        ),
        "assign_owners": lambda n: lambda: assign_owners(sizes, n),
        "owners' holders (every param)": lambda n: lambda: holders_plan(params, n),
        "plan_units (ZeRO-3)": lambda n: lambda: plan_units(model, None),
        "dp.plan (every strategy)": lambda n: lambda: dp.plan(MODEL, ranks=n),
    }
    return {name: measure_pure(make, worlds) for name, make in rows.items()}


def measure_pure(make, sizes) -> dict[int, tuple]:
    out = {}
    for n in sizes:
        fn = make(n)
        out[n] = (cpu_seconds(fn), python_peak(fn) if n == sizes[-1] else None)
    return out


# -- the checkpoint --------------------------------------------------------------------------
def rank_chunks(params, names, world: int, rank: int) -> dict[str, Chunk]:
    """ZeRO-1's checkpoint chunks of `rank` (model pieces, AdamW's moments and steps), on the
    meta device: the plan needs shapes, not values."""
    chunks = {}
    backward = list(reversed(list(zip(names, params, strict=True))))
    specs = plan_buckets([(p.numel(), p.dtype, "cpu") for _, p in backward], 25 * MB, pad_to=world)
    for spec in specs:
        members = [backward[i] for i in spec.param_indices]
        layout = ShardLayout.pack([p.numel() for _, p in members], world)
        for piece in layout.pieces(rank):
            name, p = members[piece.param]
            run = torch.empty(piece.numel, device="meta")
            for head in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/"):
                chunks[f"{head}{name}"] = Chunk(run, piece.start, p.numel(), shape=p.shape)
            chunks[f"optim/step/{name}"] = Chunk(torch.zeros((), device="meta"))
    return chunks


def local_plan(params, names, world: int, rank: int):
    planner = ChunkSavePlanner(rank_chunks(params, names, world, rank))
    return planner.create_local_plan()


def checkpoint_rows(worlds) -> dict[str, dict[int, tuple]]:
    model, _ = model_params()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    rows = {"local save plan (one rank)": {}, "create_global_plan (every rank's)": {}}
    for n in worlds:
        plan = lambda n=n: local_plan(params, names, n, n // 2)  # noqa: E731
        last = n == worlds[-1]
        rows["local save plan (one rank)"][n] = (
            cpu_seconds(plan),
            python_peak(plan) if last else None,
        )
        plans = [local_plan(params, names, n, r) for r in range(n)]
        fn = lambda plans=plans: ChunkSavePlanner({}).create_global_plan(plans)  # noqa: E731
        rows["create_global_plan (every rank's)"][n] = (
            cpu_seconds(fn, budget=0.1),
            python_peak(fn) if last else None,
        )
    return rows


# -- the engine on the fake process group -----------------------------------------------------
def one_step(model, optimizer, tokens) -> None:
    optimizer.zero_grad()
    out = model(tokens)
    (out if torch.is_tensor(out) else out[0]).float().mean().backward()
    optimizer.step()


def engine_case(strategy: str | None, world: int) -> tuple[float, float, float, int]:
    """(parallelize, build_optimizer, step) CPU seconds and held bytes of rank 0 of a fake
    world of `world` ranks; `strategy` None: the plain model's step alone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_model(MODEL)
        tokens = torch.randint(0, 256, (1, 16))
        start = time.process_time()
        if strategy is not None:
            dp.parallelize(model, strategy)
        wrapped = time.process_time()
        if strategy is not None:
            optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        built = time.process_time()
        one_step(model, optimizer, tokens)  # first-step allocations
        step = cpu_seconds(lambda: one_step(model, optimizer, tokens), budget=0.2, most=7)
        report = dp.memory_report(model, optimizer) if strategy else {}
        held = sum(report.get(k, 0) for k in ("params", "grads", "optimizer_state"))
        model = optimizer = None  # dropped before the group (runtime.destroy's rule)
        return wrapped - start, built - wrapped, step, held
    finally:
        dist.destroy_process_group()


def engine_rows(worlds) -> dict[str, dict[int, tuple]]:
    import torch._dynamo  # noqa: F401  (imported by ZeRO-3 once: not a cost of the world)

    rows: dict[str, dict[int, tuple]] = {"plain step (no engine)": {}}
    for s in STRATEGIES:
        for what in ("parallelize", "build_optimizer", "step"):
            rows[f"{s} {what}"] = {}
    for n in worlds:
        rows["plain step (no engine)"][n] = (engine_case(None, n)[2], None)
        for s in STRATEGIES:
            runs = [engine_case(s, n) for _ in range(3)]  # each a fresh model and group
            wrap, build, step = (statistics.median(r[i] for r in runs) for i in range(3))
            held = runs[0][3]
            memory = held if n == worlds[-1] else None
            rows[f"{s} parallelize"][n] = (wrap, memory)
            rows[f"{s} build_optimizer"][n] = (build, None)
            rows[f"{s} step"][n] = (step, None)
            print(f"  [{s} at {n}: {wrap:.3f} {build:.3f} {step:.3f} s]", flush=True)
    return rows


# -- the table -------------------------------------------------------------------------------
def seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def size(n: int | None) -> str:
    if n is None:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def growth(cells: dict[int, tuple], sizes) -> str:
    """Time at the largest size over time at the size 8x (or 10x) below it, and its exponent."""
    big = sizes[-1]
    small = next((s for s in sizes if s * 8 == big or s * 10 == big), None)
    if small is None or cells[small][0] <= 0:
        return ""
    ratio = cells[big][0] / cells[small][0]
    return f"x{ratio:.2g} (n^{math.log(ratio) / math.log(big / small):.2f})"


def table(groups: list[tuple[str, tuple, dict]]) -> str:
    """One markdown table; each group's title row names its sizes (fewer ones padded)."""
    lines = []
    width = max(len(sizes) for _, sizes, _ in groups)
    for title, sizes, rows in groups:
        pad = " |" * (width - len(sizes))
        head = " | ".join(f"{n:,}" for n in sizes)
        lines.append(f"| **{title}** | {head} |{pad} growth | memory at {sizes[-1]:,} |")
        if not lines[1:]:
            lines.append("|---|" + "--:|" * (width + 2))
        for name, cells in rows.items():
            times = " | ".join(seconds(cells[n][0]) for n in sizes) + pad
            memory = size(cells[sizes[-1]][1])
            lines.append(f"| {name} | {times} | {growth(cells, sizes)} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(GROUPS), help="groups of rows: " + ",".join(GROUPS)
    )
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--replicas", default=",".join(map(str, REPLICAS)))
    args = parser.parse_args()
    torch.set_num_threads(1)
    worlds = tuple(int(n) for n in args.worlds.split(","))
    replicas = tuple(int(n) for n in args.replicas.split(","))
    chosen = args.only.split(",")
    unknown = sorted(set(chosen) - set(GROUPS))
    if unknown:
        parser.error(f"--only: {unknown[0]!r} is not one of {', '.join(GROUPS)}")
    groups = []
    if "quorum" in chosen:
        rows = {"decide": measure_pure(quorum_case, replicas)}
        groups.append(("quorum, replicas:", replicas, rows))
    if "layout" in chosen:
        groups.append(("layout, ranks:", worlds, layout_rows(worlds)))
    if "checkpoint" in chosen:
        groups.append(("checkpoint, ranks:", worlds, checkpoint_rows(worlds)))
    if "engine" in chosen:
        groups.append(("engine (fake group, rank 0), ranks:", worlds, engine_rows(worlds)))
    print(table(groups))


if __name__ == "__main__":
    main()

"""`dataparallel plan --calibrate`: measure this machine and write a hardware profile.

Two ranks (gloo on 127.0.0.1, one thread each, as the benchmarks run) each train their own copy
of the model, so both cores compute as they do in a data-parallel run: the median forward +
backward time gives the FLOP rate for that model (FLOPs per token as model.py counts them),
the median optimizer step the parameters updated per second (medians over steps of the slowest
rank's time, [Note: slowest rank per step]). Then the collectives our
strategies use on gloo (all_reduce: gloo's; reduce_scatter and all_gather: our pairwise ones,
docs/zero.md) are timed at two sizes, and the alpha-beta model ([Note: collective cost]) is
fitted through the two medians.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from ..runtime import free_port
from .hardware import KINDS, HardwareProfile, profile_from_dict
from .model import builtin_shape

SIZES = (1 << 18, 1 << 22)  # fp32 elements: 1 MiB and 16 MiB


def slowest_medians(*series: list[float], group=None) -> list[float]:
    """Per series of per-repeat times (all of one length): the median over repeats of the slowest rank's time.

    [Note: slowest rank per step] A synchronous data-parallel step lasts as long as its slowest
    rank, and on busy cores which rank is slowest changes from step to step, so the step's
    median is the median of per-step maxima, above the slowest rank's median (the max of the
    medians, what calibration took before: 340 ms for gpt-small's forward+backward+AdamW
    where the no-communication bound measured 368 ms in the run after it). Calibration takes
    the statistic the validation measures.
    """
    times = torch.tensor(series, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return [statistics.median(row) for row in times.tolist()]


def _median_times(fn, repeats: int, group) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return slowest_medians(times, group=group)[0]


def measure_compute(name: str, batch: int, steps: int, group) -> tuple[float, float]:
    """(forward+backward seconds, optimizer seconds) per step, medians, slowest rank."""
    from ..models import MODEL_CONFIGS, build_model

    torch.manual_seed(0)
    model = build_model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    seq, vocab = MODEL_CONFIGS[name].block_size, MODEL_CONFIGS[name].vocab_size
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    fb, opt = [], []
    for i in range(steps + 2):
        dist.barrier(group=group)
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        middle = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        if i >= 2:
            fb.append(middle - start)
            opt.append(end - middle)
    # [Note: slowest rank per step]: the sum's per-step maximum, split in the median ratio.
    steps_total = [a + b for a, b in zip(fb, opt, strict=True)]
    (total,) = slowest_medians(steps_total, group=group)
    share = statistics.median(fb) / (statistics.median(fb) + statistics.median(opt))
    return total * share, total * (1 - share)


def measure_collectives(repeats: int, group) -> dict[str, dict[str, float]]:
    """Per kind, the link fitted through two sizes ([Note: collective cost], k = 2)."""
    from ..comm import Comm

    comm = Comm(pairwise=True)
    k = comm.world_size
    out = {}
    for kind in KINDS:
        times = []
        for numel in SIZES:
            full, shard = torch.randn(numel), torch.empty(numel // k)
            fn = {
                "all_reduce": lambda full=full: comm.all_reduce(full),
                "reduce_scatter": lambda s=shard, f=full: comm.reduce_scatter(s, f),
                "all_gather": lambda f=full, s=shard: comm.all_gather(f, s),
            }[kind]
            fn()
            times.append(_median_times(fn, repeats, group))
        factor = (2.0 if kind == "all_reduce" else 1.0) * (k - 1) / k
        x1, x2 = (4 * n for n in SIZES)
        bandwidth = factor * (x2 - x1) / max(times[1] - times[0], 1e-9)
        latency = max((times[0] - factor * x1 / bandwidth) / 2, 1e-6)
        out[kind] = {"bandwidth": bandwidth, "latency": latency}
    return out


def _worker(rank: int, port: int, names: list[str], batch: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    compute = {n: measure_compute(n, batch, 8, group) for n in names}
    links = measure_collectives(10, group)
    if rank == 0:
        Path(path).write_text(json.dumps({"compute": compute, "links": links}))
    dist.barrier()
    dist.destroy_process_group()


def calibrate(names: list[str], batch: int = 4, out: str | None = None) -> HardwareProfile:
    """Measure this machine with 2 ranks; write the profile to `out` when given."""
    os.environ["OMP_NUM_THREADS"] = "1"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calibration.json")
        mp.spawn(_worker, args=(port, names, batch, path), nprocs=2, join=True)
        measured = json.loads(Path(path).read_text())
    rates, optimizer = {}, []
    for name, (fb, opt) in measured["compute"].items():
        shape = builtin_shape(name, None, torch.float32, None)
        rates[name] = batch * shape.seq_len * shape.flops_per_token / fb
        optimizer.append(shape.params / opt)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    raw = {
        "name": f"this machine: {os.cpu_count()} CPUs, 2 ranks on gloo, 1 thread each",
        "flops_per_s": rates[names[0]],
        "compute_rates": rates,
        "optimizer_params_per_s": statistics.median(optimizer),
        "memory_bytes": memory,
        "ranks_per_node": 2,
        "intra_node": measured["links"],
        "inter_node": measured["links"]["all_reduce"],  # one machine: never used
        "overlap": 0.0,
        "backend": "gloo",
        "sources": {
            "flops_per_s": f"measured {stamp}: plain AdamW steps of {', '.join(names)}, "
            f"batch {batch}, 2 ranks at once, median over steps of the slowest rank's "
            "forward+backward",
            "optimizer_params_per_s": f"measured {stamp}: median AdamW step (slowest rank)",
            "memory_bytes": "half of this machine's RAM",
            "intra_node": f"measured {stamp}: medians of 10 calls at 1 and 16 MiB, fitted",
            "overlap": "0: gloo's threads need the cores the ranks compute on",
        },
    }
    profile = profile_from_dict(raw, "calibration")
    if out:
        Path(out).write_text(profile.to_json() + "\n")
    return profile

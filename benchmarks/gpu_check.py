"""The GPU check: every CUDA/NCCL path of the engine on one GPU, and its own per-step overhead.

    make gpu-check                                   # the machine's own CUDA torch; installs nothing
    PYTHONPATH=src python3 benchmarks/gpu_check.py   # the same
    python benchmarks/gpu_check.py --device cpu      # the same code paths on CPU (a smoke test)

Each section (the cases are in gpu_cases.py) runs in a fresh world of its own with a time
limit; a section that fails or hangs is a row of the table and the check goes on. The table is
rewritten to --out after each section and printed at the end (--json: the rows as JSON); the
exit status is 1 if a row failed. Sections: parity on one rank with NCCL (every strategy x
{fp32, bf16 parameters, fp16 parameters with GradScaler}, against plain PyTorch in the same
precision); every strategy on two ranks sharing the GPU over gloo; a Hugging Face Llama; memory;
checkpoints across strategies; compiled blocks; step times against PyTorch DDP and FSDP2;
host_time.py's table; the `dataparallel train` job through its launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp
from gpu_cases import (
    all_parity,
    benchmarks,
    checkpoints,
    compiled_parity,
    fp32_parity,
    hf_parity,
    memory,
)

import dataparallel as dp


def _rank(rank, world_size, port, backend, device_type, job, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK="0",  # every rank shares the one GPU
        WORLD_SIZE=str(world_size),
    )
    try:
        if device_type == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        world = dp.init(backend=backend, threads=1 if device_type == "cpu" else None)
        queue.put((rank, job(world)))
    except BaseException:
        queue.put(
            (
                rank,
                [
                    {
                        "check": job.__name__,
                        "case": "world",
                        "ok": False,
                        "value": traceback.format_exc().splitlines()[-1][:120],
                    }
                ],
            )
        )
    finally:
        dp.destroy()


def run_world(world_size: int, backend: str, device_type: str, job, timeout: float) -> list[dict]:
    """`job(world)` in a fresh world of `world_size` processes; rank 0's rows. A world that
    has not answered within `timeout` seconds is ended and reported as a row (the check goes
    on with the next section)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world_size, port, backend, device_type, job, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world_size:
            rank, rows = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = rows
    except queue_module.Empty:
        missing = sorted(set(range(world_size)) - set(results))
        row = {"check": job.__name__, "case": "world", "ok": False,
               "value": f"no answer from rank(s) {missing} within {timeout:.0f} s; ended"}  # fmt: skip
        results.setdefault(0, [row])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results[0]


def host_times(world):
    """benchmarks/host_time.py's table on this device (gpt-deep-narrow)."""
    from host_time import measure, parameter_tensors, table

    rows = table([measure(world, "gpt-deep-narrow")], parameter_tensors("gpt-deep-narrow"))
    return [
        {
            "check": "host time deep-narrow",
            "case": r["contender"],
            "ok": True,
            "value": f"step {r['step_ms']:.2f} ms, host {r['host_ms']:.2f} ms, "
            f"{r['host_us_per_param']:+.2f} us/param over bound, "
            f"exposed {r['exposed_ms']:+.2f} ms",
        }  # fmt: skip
        for r in rows
    ]


def job(device_type: str, timeout: float) -> list[dict]:
    """`dataparallel train` (the job, through its launcher) on one rank of this device."""
    folder = tempfile.mkdtemp(prefix="gpu-check-job-")
    command = [sys.executable, "-m", "dataparallel.cli", "train", "--steps", "20", "--nproc",
               "1", "--strategy", "zero3", "--out", f"{folder}/run"]  # fmt: skip
    case = "train --nproc 1 --strategy zero3 --steps 20"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [
            {"check": "job", "case": case, "ok": False, "value": f"timed out ({timeout:.0f} s)"}
        ]
    try:
        with open(f"{folder}/run/run.json") as f:
            run = json.load(f)
        with open(f"{folder}/run/metrics.jsonl") as f:
            val = [r["val_loss"] for r in map(json.loads, f) if r.get("kind") == "val"]
        value = f"{run['device']}/{run['backend']}, val {val[0]:.4f} -> {val[-1]:.4f}"
        ok = done.returncode == 0 and run["device"].startswith(device_type) and val[-1] < val[0]
    except (OSError, KeyError, IndexError, ValueError) as exc:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        value, ok = f"exit {done.returncode}: {tail[0][:100]} ({type(exc).__name__})", False
    shutil.rmtree(folder, ignore_errors=True)
    return [{"check": "job", "case": case, "ok": ok, "value": value}]


# (name, world size, backend, job, seconds it may take): the sections in the order they run.
def sections(device_type: str) -> list[tuple]:
    single = "nccl" if device_type == "cuda" else "gloo"
    return [
        ("parity", 1, single, all_parity, 90),
        ("gloo with device tensors", 2, "gloo", fp32_parity, 60),
        ("hf models", 1, single, hf_parity, 60),
        ("memory", 1, single, memory, 45),
        ("checkpoints", 1, single, checkpoints, 60),
        ("compile", 1, single, compiled_parity, 150),
        ("step times", 1, single, benchmarks, 90),
        ("host time", 1, single, host_times, 90),
    ]


def render(rows: list[dict], device_name: str, started: float) -> str:
    lines = [
        f"gpu_check: torch {torch.__version__}, {device_name}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - started:.0f} s",
        "",
        "| check | case | ok | value |",
        "|---|---|---|---|",
    ]
    for row in rows:
        ok = "yes" if row["ok"] else "NO"
        lines.append(f"| {row['check']} | {row['case']} | {ok} | {row['value']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--out", default="gpu_check.md", help="the table, rewritten after each section"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--budget", type=float, default=270,
                        help="seconds for the whole check: sections that would start later are "
                             "reported as skipped")  # fmt: skip
    parser.add_argument("--only", help="comma-separated section names (default: all)")
    parser.add_argument("--patience", type=float, default=1.0,
                        help="multiplies each section's time limit (a slow or busy machine)")  # fmt: skip
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: torch {torch.__version__} sees no CUDA device (--device cpu: a smoke run)"
        )
        return 2
    started = time.monotonic()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows: list[dict] = []
    chosen = set(args.only.split(",")) if args.only else None
    for title, size, backend, work, timeout in [*sections(args.device), ("job", 0, "", None, 120)]:
        if chosen is not None and title not in chosen:
            continue
        left, timeout = args.budget - (time.monotonic() - started), timeout * args.patience
        if left < 10:
            rows.append(
                {"check": title, "case": "-", "ok": False, "value": "skipped: budget spent"}
            )
            continue
        begun = time.monotonic()
        if work is None:
            rows += job(args.device, min(timeout, left))
        else:
            rows += run_world(size, backend, args.device, work, min(timeout, left))
        print(f"gpu_check: {title} done in {time.monotonic() - begun:.0f} s", flush=True)
        with open(args.out, "w") as f:
            f.write(render(rows, name, started))
    text = render(rows, name, started)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where users train: a Llama of about 1B parameters on one GPU, against the physical limit
(issue 40). Tokens/s, MFU, the CUDA peak against `dataparallel plan`'s, for the bound, PyTorch
DDP and FSDP2, the Hugging Face Trainer, our API and our job; AdamW's step alone (our flat step
against torch's for-loop, foreach and fused); a LoRA fine-tune of a random Llama 3 8B.

    make gpu-throughput                                        # the GPU machine's python3
    PYTHONPATH=src python3 benchmarks/gpu_throughput.py        # the same
    python benchmarks/gpu_throughput.py --device cpu --size toy --compile-backend eager
                                                               # every path on CPU, tiny

Contenders run one after another in this one process (seven 1B models with AdamW do not fit
at once), the job in a process of its own; each is built, warmed up (the compile happens in
the first warm-up step), timed over --steps steps on one fixed batch and freed. The table is
rewritten to --out after each contender (a run cut short keeps what it measured); contenders
that would start with less than --reserve seconds of --budget left are rows saying so. A path
that does not run here is a row with its error, and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time
import traceback

import throughput_contenders as tc
import torch
from throughput_models import SIZES, flops_per_token, planned_peak
from throughput_optimizer import optimizer_rows

import dataparallel as dp
from dataparallel.plan.flops import FORMULA, mfu, peak_flops

# name -> (run, the plan's (strategy, precision) for its peak, compiled, why not on CPU or "")
CONTENDERS = {
    "bound": (tc.bound, ("ddp", "bf16"), True, ""),
    "ours-ddp": (tc.ours("ddp"), ("ddp", "bf16-params"), True, ""),
    "ours-zero3": (tc.ours("zero3"), ("zero3", "bf16-params"), True, ""),
    "fsdp2": (tc.fsdp2, ("zero3", "bf16-params"), True, ""),
    "torch-ddp": (tc.torch_ddp, ("ddp", "bf16"), True, ""),
    "hf-trainer": (tc.hf_trainer, ("ddp", "bf16"), False, ""),
    "job": (tc.job, (tc.JOB_STRATEGY, tc.JOB_PRECISION), False, ""),
}
LORA = {"ours-ddp-lora": (tc.ours("ddp"), ("ddp", "bf16-params"), False, "")}
SECTIONS = ("throughput", "optimizer", "lora")


def world_of_one(device: str):
    """A process group of this process alone (nccl on CUDA, gloo on CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    return dp.init(
        backend="nccl" if device == "cuda" else "gloo", threads=None if device == "cuda" else 1
    )


def measure(name: str, entry, ctx: tc.Context, peak: float | None) -> dict:
    """One contender's row: tokens/s (median step), MFU, the measured and the planned peak."""
    run, plan_as, compiled, _ = entry
    flops = flops_per_token(ctx.size)
    row = {
        "section": "lora" if ctx.size.lora else "throughput",
        "contender": name,
        "model": ctx.size.name,
        "compiled": compiled,
        "flops_per_token": flops,
    }
    try:
        got = run(ctx)
    except Exception as exc:  # a path that does not run here is a result too
        traceback.print_exc()
        return {**row, "ok": False, "note": f"{type(exc).__name__}: {str(exc)[:140]}"}
    tokens_per_s = got.tokens_per_s or ctx.size.tokens_per_step / _median(got.step_s)
    plan_bytes = planned_peak(ctx.size, *plan_as) if plan_as else 0.0
    return {
        **row,
        "ok": bool(got.losses) and all(math.isfinite(x) for x in got.losses),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, flops, peak) if peak else None,
        "peak_bytes": got.peak_bytes,
        "plan_bytes": plan_bytes or None,
        "plan_row": "/".join(plan_as) if plan_as else "n/a",
        "losses": got.losses,
        "note": got.note,
    }


def run_one(name: str, entry, ctx: tc.Context, peak: float | None, skip: bool) -> dict:
    """`measure`'s row, or one saying it was skipped (the budget is spent)."""
    if skip:
        section = "lora" if ctx.size.lora else "throughput"
        return {
            "section": section,
            "contender": name,
            "model": ctx.size.name,
            "ok": False,
            "note": "skipped: budget spent",
        }
    _fresh(ctx.device)
    begun = time.monotonic()
    row = measure(name, entry, ctx, peak)
    print(f"gpu_throughput: {name} done in {time.monotonic() - begun:.0f} s", flush=True)
    return row


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def _gb(value) -> str:
    return f"{value / 1e9:.3g}" if value else "-"


def render(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        f"MFU: {FORMULA}",
        "",
        "| contender | model | compiled | tokens/s | MFU | peak GB | plan GB | plan row "
        "| plan / peak | first loss | last loss | note |",
        "|---|---|---|--:|--:|--:|--:|---|--:|--:|--:|---|",
    ]
    for r in (r for r in rows if r["section"] != "optimizer"):
        ratio = (
            r["plan_bytes"] / r["peak_bytes"]
            if r.get("plan_bytes") and r.get("peak_bytes")
            else None
        )
        losses = r.get("losses") or [float("nan")]
        cells = [
            r["contender"],
            r["model"],
            "yes" if r.get("compiled") else "no",
            f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-",
            f"{r['mfu']:.1%}" if r.get("mfu") else "-",
            _gb(r.get("peak_bytes")),
            _gb(r.get("plan_bytes")),
            r.get("plan_row", "-"),
            f"{ratio:.3f}" if ratio else "-",
            f"{losses[0]:.4f}",
            f"{losses[-1]:.4f}",
            ("" if r.get("ok") else "FAILED: ") + r.get("note", ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    optimizer = [r for r in rows if r["section"] == "optimizer"]
    if optimizer:
        lines += [
            "",
            "AdamW's step alone (fp32), median ms:",
            "",
            "| model | implementation | ms | vs foreach | note |",
            "|---|---|--:|--:|---|",
        ]
        for r in optimizer:
            ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "-"
            versus = f"{r['vs_foreach']:.2f}x" if r.get("vs_foreach") else "-"
            lines.append(
                f"| {r['model']} | {r['implementation']} | {ms} | {versus} | {r['note']} |"
            )
    return "\n".join(lines) + "\n"


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--size",
        default="1b",
        choices=["1b", "toy"],
        help="1b: Llama 3.2 1B at sequence 2048 (and an 8B for LoRA); toy: tiny, for CPU",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=330,
        help="seconds for the whole run (6 minutes of device time with the start)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        default=None,
        help="a contender starts only with this many seconds left (default: 40 on CUDA, 5 on CPU)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 8; toy 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the compile)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections: {','.join(SECTIONS)}")
    p.add_argument("--contenders", help="comma-separated (default: all)")
    p.add_argument("--compile-backend", default="inductor", help="eager: the CPU smoke run")
    p.add_argument(
        "--job-timeout",
        type=float,
        default=150,
        help="seconds the job may take (its logged steps count if cut)",
    )
    p.add_argument("--peak-flops", type=float, help="the device's dense bf16 FLOP/s for MFU")
    p.add_argument("--out", default="gpu_throughput.md", help="the table, after each contender")
    p.add_argument("--json", help="also write the rows here, after each contender")
    return p.parse_args()


def main() -> int:
    args = arguments()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_throughput: torch {torch.__version__} sees no CUDA device (--device cpu)")
        return 2
    started = time.monotonic()
    world = world_of_one(args.device)
    device = world.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_flops or peak_flops(name)
    reserve = args.reserve if args.reserve is not None else (40 if device.type == "cuda" else 5)
    steps = args.steps or (8 if args.size == "1b" else 3)
    header = (
        f"gpu_throughput: torch {torch.__version__}, {name}, --size {args.size}, "
        f"{steps} timed steps after {args.warmup}, compile {args.compile_backend}"
    )
    sections = args.only.split(",")
    chosen = set(args.contenders.split(",")) if args.contenders else None
    rows: list[dict] = []

    def left() -> float:
        return args.budget - (time.monotonic() - started)

    def context(size_name: str) -> tc.Context:
        return tc.Context(
            SIZES[size_name],
            device,
            world,
            steps,
            args.warmup,
            args.compile_backend,
            timeout=max(10.0, min(left() - 5, args.job_timeout)),
        )

    def write() -> None:
        with open(args.out, "w") as f:
            f.write(render(rows, f"{header}, {time.monotonic() - started:.0f} s"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    lora_size = "8b-lora" if args.size == "1b" else "toy-lora"
    for section in sections:
        if section == "optimizer":
            _fresh(device)
            for r in optimizer_rows(context(args.size), lambda: left() >= reserve):
                rows.append({"section": "optimizer", **r})
            write()
            continue
        size_name, contenders = (
            (args.size, CONTENDERS) if section == "throughput" else (lora_size, LORA)
        )
        for contender, entry in contenders.items():
            if chosen is None or contender in chosen:
                rows.append(run_one(contender, entry, context(size_name), peak, left() < reserve))
                write()
    print(render(rows, f"{header}, {time.monotonic() - started:.0f} s"), flush=True)
    dp.destroy()
    return 0 if rows and all(r.get("ok", True) for r in rows) else 1


def _fresh(device: torch.device) -> None:
    """Free the last contender's model (reference cycles of hooks hold it) and start the
    peak anew."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


if __name__ == "__main__":
    sys.exit(main())

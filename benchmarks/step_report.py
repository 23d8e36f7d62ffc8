"""bench_step.py's record of a run: the machine, then tables of every contender, ours over
peers, and new over old (`--baseline`)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys

import torch
from contenders import bench_model

MIB = 1024 * 1024
# The memory the table adds up; reports may carry more (e.g. master_params, a part of the
# optimizer state, or a transient peak), which the JSON keeps.
HELD = ("params", "grads", "optimizer_state")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict:
    return {
        "command": "python " + shlex.join(sys.argv),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_start": os.getloadavg(),
    }


def held_mib(row: dict) -> float:
    return sum(row["memory_bytes"].get(k, 0) for k in HELD) / MIB


def ratio(value: float | None) -> str:
    return f"{value:.3f}x" if value else "-"


def table_row(name: str, row: dict) -> str:
    mem = row["memory_bytes"]
    cells = [
        name,
        f"{row['median_s'] * 1e3:.1f}",
        f"{row['p25_s'] * 1e3:.1f}-{row['p75_s'] * 1e3:.1f}",
        f"{row['cpu_median_s'] * 1e3:.1f}",
        f"{row['tokens_per_s']:,.0f}",
        ratio(row["vs_bound"]),
        ratio(row["vs_bound_paired"]),
        *(f"{mem.get(k, 0) / MIB:.1f}" for k in HELD),
        f"{held_mib(row):.1f}",
        f"{row['final_loss']:.4f}",
    ]
    return "| " + " | ".join(cells) + " |"


def render(meta: dict, summary: dict, skipped: dict, args) -> str:
    params = sum(p.numel() for p in bench_model(args.model).parameters())
    lines = [
        f"## Step time: {args.model} ({params / 1e6:.2f}M params), {args.nproc} ranks x 1 "
        f"thread, {summary['tokens_per_step']:,} tokens/step, fp32 AdamW",
        "",
        f"- command: `{meta['command']}`",
        f"- torch {meta['torch']}; {meta['cpus']} CPUs ({meta['cpu_model']}); {meta['date']}",
        f"- load average at start {meta['load_average_start'][0]:.2f}, "
        f"at end {meta['load_average_end'][0]:.2f} (1 min)",
        f"- {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps, "
        f"interleaved by {args.interleave}; median over all timed steps, each the slowest "
        "rank's; paired: median of per-step ratios",
    ]
    if args.baseline:
        lines.append(
            f"- `old-*`: the package of commit {args.baseline_commit[:12]} "
            f"(`--baseline {args.baseline}`)"
        )
    lines += [
        "",
        "| contender | median ms | p25-p75 ms | CPU ms | tokens/s | vs bound | paired "
        "| params MiB | grads MiB | optimizer MiB | total MiB | final loss |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    lines += [table_row(name, row) for name, row in summary["rows"].items()]
    if summary["pairs"]:
        lines += ["", "| ours | peer | ours / peer (medians) | paired |", "|---|---|--:|--:|"]
        lines += [
            f"| {p['ours']} | {p['peer']} | {p['ratio']:.3f}x | {ratio(p['paired'])} |"
            for p in summary["pairs"]
        ]
    lines += versus_old_table(summary)
    if skipped:
        lines += [""] + [f"- skipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def versus_old_table(summary: dict) -> list[str]:
    """Each of ours beside its `old-` twin: below 1.000x the new code is faster (or smaller)."""
    if not summary.get("versus_old"):
        return []
    rows = summary["rows"]
    lines = [
        "",
        "| new vs old | new ms | old ms | new / old (medians) | paired | paired CPU "
        "| total MiB new / old | loss new - old |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for pair in summary["versus_old"]:
        new, old = rows[pair["new"]], rows[pair["old"]]
        cells = [
            pair["new"],
            f"{new['median_s'] * 1e3:.1f}",
            f"{old['median_s'] * 1e3:.1f}",
            ratio(pair["ratio"]),
            ratio(pair["paired"]),
            ratio(pair["paired_cpu"]),
            ratio(held_mib(new) / held_mib(old)),
            f"{new['final_loss'] - old['final_loss']:+.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines

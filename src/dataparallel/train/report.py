"""The end-of-run report: PNG plots of the losses and the throughput, and a one-screen summary.

Everything is computed from the files of the run directory (metrics.jsonl, run.json), so a
resumed run's report covers all of its steps, and `make_report(run_dir)` can be called again
on any finished run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .console import format_count, format_duration, plural
from .metrics import read_metrics
from .run_dir import REPORT, RUN_INFO, TENSORBOARD
from .tensor_parallel import mesh_text
from .trace_report import load_traces, plot_timeline, summarize_traces, trace_lines


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average (debiased, so the first points are not pulled to 0)."""
    out, average = [], 0.0
    for i, v in enumerate(values, start=1):
        average = weight * average + (1 - weight) * v
        out.append(average / (1 - weight**i))
    return out


def _plot(run_dir: Path, train: list[dict], val: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; works on any machine
    import matplotlib.pyplot as plt

    folder = run_dir / REPORT
    paths = [folder / "loss.png", folder / "throughput.png"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["loss"] for r in train], color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(steps, _smooth([r["loss"] for r in train]), color="tab:blue", label="train (EMA)")
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["val_loss"] for r in val],
            "o-",
            color="tab:orange",
            label="validation",
        )
    ax.set(xlabel="step", ylabel="loss (nats per token)", title=f"Loss: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    rates = [r["tokens_per_s"] for r in train]
    ax.plot(steps, rates, color="tab:green", lw=0.8, label="per step")
    if rates:
        ax.axhline(statistics.median(rates), color="black", ls="--", lw=0.8, label="median")
    ax.set(xlabel="step", ylabel="tokens / s (all ranks)", title="Throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def summarize(run_dir: Path) -> dict:
    """The numbers of a run, from its files."""
    records = read_metrics(run_dir)
    info = json.loads((run_dir / RUN_INFO).read_text()) if (run_dir / RUN_INFO).exists() else {}
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    tail = [r["loss"] for r in train[-10:]]
    rates = [r["tokens_per_s"] for r in train[2:]] or [r["tokens_per_s"] for r in train]
    return {
        "run_dir": str(run_dir),
        "steps_done": train[-1]["step"] if train else 0,
        "steps_total": info.get("steps"),
        "first_train_loss": train[0]["loss"] if train else None,
        "final_train_loss": train[-1]["loss"] if train else None,
        "final_train_loss_mean": sum(tail) / len(tail) if tail else None,
        "final_train_loss_mean_of": len(tail),
        "first_val_loss": val[0]["val_loss"] if val else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "tokens_seen": sum(r["tokens"] for r in train),
        "tokens_per_s_median": statistics.median(rates) if rates else 0.0,
        # rank 0's bytes handed to collectives per step (older runs have no such key)
        "bytes_sent_per_step": (
            sum(r.get("bytes_sent", 0) for r in train) / len(train) if train else 0.0
        ),
        # what rank 0 put on the wire per step ([Note: bytes on the wire] in comm/wire.py)
        "wire_bytes_per_step": (
            sum(r.get("wire_bytes", 0) for r in train) / len(train) if train else 0.0
        ),
        "train_time_s": sum(r["step_time_s"] for r in train),
        "eval_time_s": sum(r["eval_time_s"] for r in val),
        "info": info,
        "trace": summarize_traces(run_dir),  # None without --trace
    }


def summary_text(summary: dict, run_dir: Path) -> str:
    info = summary["info"]
    done, total = summary["steps_done"], summary["steps_total"]
    finished = total is None or done >= total
    lines = [
        "dataparallel train: " + ("done" if finished else f"stopped at step {done} of {total}"),
        f"  run       {run_dir}",
        f"  model     {info.get('model')} ({info.get('parameters', 0) / 1e6:.2f}M parameters) "
        f"on {info.get('corpus', {}).get('description', '?')}",
        f"  world     {mesh_text(info.get('world_size', 1), info.get('tp', 1))} x {plural(info.get('threads', 1), 'thread')}, "
        f"{info.get('strategy')}, global batch {info.get('global_batch')} windows = "
        f"{info.get('tokens_per_step')} tokens/step",
        f"  time      {done} steps: {format_duration(summary['train_time_s'])} training, "
        f"{format_duration(summary['eval_time_s'])} validation",
    ]
    if summary["final_train_loss"] is not None:
        lines.append(
            f"  loss      train {summary['first_train_loss']:.4f} -> "
            f"{summary['final_train_loss_mean']:.4f} "
            f"(mean of the last {summary['final_train_loss_mean_of']} steps)"
        )
    if summary["final_val_loss"] is not None:
        lines.append(
            f"            val   {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f}"
        )
    lines += [
        f"  speed     {format_count(summary['tokens_per_s_median'])} tokens/s (median), "
        f"{format_count(summary['tokens_seen'])} tokens trained on",
        f"  traffic   {format_count(summary['wire_bytes_per_step'])}B on the wire per step by "
        f"rank 0 ({format_count(summary['bytes_sent_per_step'])}B handed to collectives)",
    ]
    plots = "loss.png, throughput.png"
    if summary.get("trace"):
        lines += trace_lines(summary["trace"])
        plots += ", timeline.png"
    lines += [
        f"  weights   {run_dir / 'model.safetensors'}",
        f"  metrics   {run_dir / 'metrics.jsonl'}"
        + (
            f"; tensorboard --logdir {run_dir / TENSORBOARD}"
            if (run_dir / TENSORBOARD).is_dir()
            else ""
        ),
        f"  report    {run_dir / REPORT}/{plots}, summary.txt"
        if not summary.get("plots_skipped")
        else f"  report    {run_dir / REPORT}/summary.txt (no plots: {summary['plots_skipped']})",
    ]
    if finished:
        lines.append(f'  next      dataparallel sample {run_dir} --prompt "def "')
    else:
        lines.append(f"  next      dataparallel train --resume {run_dir}")
    return "\n".join(lines)


def make_report(run_dir: str | Path) -> str:
    """Write run_dir/report/{loss.png, throughput.png, summary.txt, summary.json} (and
    timeline.png, of the last traced step, when the run was traced); return the summary text."""
    run_dir = Path(run_dir)
    (run_dir / REPORT).mkdir(exist_ok=True)
    summary = summarize(run_dir)
    records = read_metrics(run_dir)
    try:
        _plot(
            run_dir,
            [r for r in records if r["kind"] == "train"],
            [r for r in records if r["kind"] == "val"],
        )
        if summary["trace"]:
            timeline = run_dir / REPORT / "timeline.png"
            plot_timeline(timeline, load_traces(run_dir), summary["trace"]["last_step"])
    except Exception as exc:  # noqa: BLE001 - a machine whose matplotlib cannot start
        # (seen: its font cache calling a broken `fc-list`) still gets the run's summary.
        reason = str(exc).splitlines()[0][:80] if str(exc) else ""
        summary["plots_skipped"] = f"matplotlib failed: {type(exc).__name__} {reason}".strip()
    text = summary_text(summary, run_dir)
    (run_dir / REPORT / "summary.txt").write_text(text + "\n")
    (run_dir / REPORT / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return text

"""What the report says about a traced run: where each step's time went, and a timeline.

Read from the run's traces/rank<N>.json (train/tracing.py), so it works on any finished run.
Per traced step and rank ([Note: trace spans] in comm/trace.py):
- phases: the summed time of the training thread's top-level phases (data, forward,
  backward, optimizer, averager, loss); `coverage` is their share of the step's wall time;
- exposed communication: the union of the training thread's waits on collectives (it can do
  nothing else meanwhile), as a share of the step;
- communication in flight: the union of the collectives' spans; what of it is not exposed ran
  behind compute (overlap).
"""

from __future__ import annotations

import json
from pathlib import Path

from .tracing import TRACES, TRAINING_THREAD

PHASE_COLOURS = {
    "data": "tab:gray",
    "forward": "tab:blue",
    "backward": "tab:green",
    "optimizer": "tab:purple",
    "averager": "tab:brown",
    "loss": "tab:olive",
}
COMM_COLOURS = {
    "all_reduce": "tab:orange",
    "reduce_scatter": "tab:red",
    "all_gather": "tab:cyan",
    "broadcast": "tab:pink",
    "all_to_all": "gold",
}


def load_traces(run_dir: Path) -> dict[int, list[dict]]:
    """Each rank's complete events ("ph": "X"), by rank."""
    traces = {}
    for path in sorted((Path(run_dir) / TRACES).glob("rank*.json")):
        trace = json.loads(path.read_text())
        rank = trace.get("otherData", {}).get("rank", int(path.stem.removeprefix("rank")))
        traces[rank] = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return dict(sorted(traces.items()))


def _union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _within(events: list[dict], start: float, end: float, cat: str) -> list[tuple[float, float]]:
    """The events of category `cat` that start in [start, end), clipped to it."""
    return [
        (max(e["ts"], start), min(e["ts"] + e["dur"], end))
        for e in events
        if e["cat"] == cat and start <= e["ts"] < end
    ]


def step_breakdown(events: list[dict]) -> list[dict]:
    """Per traced step of one rank: its wall time and where it went (microseconds)."""
    rows = []
    for step in (e for e in events if e["cat"] == "step"):
        start, wall = step["ts"], step["dur"]
        end = start + wall
        phases = [e for e in events if e["cat"] == "compute" and start <= e["ts"] < end]
        blocked = _within(events, start, end, "blocked")
        comm = _within(events, start, end, "comm")
        exposed = _union(blocked)
        rows.append(
            {
                "step": step["args"]["step"],
                "start_us": start,
                "wall_us": wall,
                "phases_us": sum(e["dur"] for e in phases),
                "coverage": sum(e["dur"] for e in phases) / wall if wall else 0.0,
                "exposed_comm_us": exposed,
                "exposed_comm_fraction": exposed / wall if wall else 0.0,
                "comm_in_flight_us": _union(comm),
                "comm_bytes": sum(
                    e["args"].get("bytes", 0)
                    for e in events
                    if e["cat"] == "comm" and start <= e["ts"] < end
                ),
            }
        )
    return rows


def summarize_traces(run_dir: Path) -> dict | None:
    """Per rank, the traced steps' breakdowns and the mean exposed fraction; None: no trace."""
    traces = load_traces(run_dir)
    if not traces:
        return None
    ranks = {}
    for rank, events in traces.items():
        rows = step_breakdown(events)
        wall = sum(r["wall_us"] for r in rows)
        ranks[rank] = {
            "steps": rows,
            "exposed_comm_fraction": sum(r["exposed_comm_us"] for r in rows) / wall if wall else 0,
            "coverage": sum(r["phases_us"] for r in rows) / wall if wall else 0.0,
        }
    steps = [r["step"] for rows in ranks.values() for r in rows["steps"]]
    return {"ranks": ranks, "first_step": min(steps, default=0), "last_step": max(steps, default=0)}


def plot_timeline(path: Path, traces: dict[int, list[dict]], step: int) -> Path | None:
    """One step per rank: phases and waits on the training thread, the collectives below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = {}
    for rank, events in traces.items():
        match = [e for e in events if e["cat"] == "step" and e["args"].get("step") == step]
        if match:
            shown[rank] = match[0]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(10, 1.0 + 1.1 * len(shown)), dpi=110)
    labels, ticks = [], []
    for row, (rank, step_event) in enumerate(shown.items()):
        start, end = step_event["ts"], step_event["ts"] + step_event["dur"]
        y = -row * 3.0
        for e in traces[rank]:
            if not start <= e["ts"] < end or e["cat"] == "step":
                continue
            x, width = (e["ts"] - start) / 1000, e["dur"] / 1000
            if e["cat"] == "compute":
                ax.broken_barh([(x, width)], (y + 1.0, 0.9), color=PHASE_COLOURS.get(e["name"]))
            elif e["cat"] == "blocked":
                ax.broken_barh([(x, width)], (y + 1.0, 0.9), color="black", alpha=0.75)
            elif e["cat"] == "comm":
                lane = e["tid"] - TRAINING_THREAD - 1
                colour = COMM_COLOURS.get(e["name"], "tab:orange")
                height = 0.9 / max(1, _lanes_in(traces[rank], start, end))
                ax.broken_barh([(x, width)], (y + lane * height, height * 0.9), color=colour)
        labels += [f"rank {rank} comm", f"rank {rank} compute"]
        ticks += [y + 0.45, y + 1.45]
    ax.set_yticks(ticks, labels)
    ax.set_xlabel(f"ms since the start of step {step}")
    ax.set_title(f"Step {step}: compute against communication (black: waiting on a collective)")
    kinds = {e["name"] for events in traces.values() for e in events if e["cat"] == "comm"}
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()]
    handles += [Patch(color="black", alpha=0.75, label="wait")]
    handles += [Patch(color=COMM_COLOURS.get(k, "tab:orange"), label=k) for k in sorted(kinds)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _lanes_in(events: list[dict], start: float, end: float) -> int:
    """How many collective lanes the step uses (the highest lane's number)."""
    tids = [e["tid"] for e in events if e["cat"] == "comm" and start <= e["ts"] < end]
    return max(tids, default=TRAINING_THREAD + 1) - TRAINING_THREAD


def trace_lines(summary: dict) -> list[str]:
    """The summary's lines about the trace."""
    first, last = summary["first_step"], summary["last_step"]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    per_rank = ", ".join(
        f"rank {rank} {info['exposed_comm_fraction']:.1%}"
        for rank, info in summary["ranks"].items()
    )
    return [
        f"  trace     {steps}: exposed communication {per_rank} of the step time "
        "(training thread waiting on collectives)"
    ]

"""`--trace STEPS`: record some steps' spans on every rank and write them as Chrome traces.

The trainer opens a span per phase of a step (data, forward, backward, optimizer, averager,
loss), the comm layer records every collective in flight and every wait of the training
thread on one ([Note: trace spans] in comm/trace.py); `TraceWriter` switches the tracer on for
the chosen steps and writes RUN_DIR/traces/rank<N>.json after the last of them. The file is a
Chrome trace (the JSON object form, complete events "ph": "X" in microseconds), which
ui.perfetto.dev and chrome://tracing open as it is: one process per rank, the training thread
on tid 0 (phases, with the waits nested inside), collectives on tids 1, 2, ... (one lane each
for collectives in flight at the same time).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..comm import Span, Tracer
from .callbacks import Callback
from .ledger import StepRecord
from .state import TrainState

TRACES = "traces"
TRAINING_THREAD = 0  # the tid of the training thread's phases and waits


def parse_steps(text: str) -> tuple[int, int]:
    """The first and last step of "FIRST-LAST" or "STEP" (ValueError saying what is wrong)."""
    first, dash, last = text.strip().partition("-")
    try:
        low, high = int(first), int(last) if dash else int(first)
    except ValueError:
        raise ValueError(f"{text!r} is not a step or a range of steps") from None
    if low < 1 or high < low:
        raise ValueError(f"{text!r} is not a range FIRST-LAST with 1 <= FIRST <= LAST")
    return low, high


def trace_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / TRACES / f"rank{rank}.json"


class TraceWriter(Callback):
    """Traces the steps `first`..`last` (as numbered in the metrics) of every rank.

    Give it to every rank, last among the callbacks, so that nothing the others do between
    steps (a checkpoint's gathers) lands in the trace.
    """

    def __init__(self, run_dir: Path, first: int, last: int):
        self.run_dir, self.first, self.last = Path(run_dir), first, last
        self.written = False

    def _arm(self, state: TrainState) -> None:
        """Trace the next step if it is one of ours."""
        state.tracer.enabled = self.first <= state.step + 1 <= self.last

    def on_start(self, state: TrainState) -> None:
        state.tracer.clear()
        self._arm(state)

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        if record.step >= self.last:
            self._write(state)
        else:
            self._arm(state)

    def on_end(self, state: TrainState) -> None:
        self._write(state)  # the run stopped inside the range (--stop-after)

    def _write(self, state: TrainState) -> None:
        state.tracer.enabled = False
        if self.written or not state.tracer.spans:
            return
        path = trace_path(self.run_dir, state.world.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        trace = chrome_trace(state.tracer, state.world.rank, (self.first, self.last))
        path.write_text(json.dumps(trace) + "\n")
        state.tracer.clear()
        self.written = True


def chrome_trace(tracer: Tracer, rank: int, steps: tuple[int, int]) -> dict:
    """The tracer's spans and instants as a Chrome trace of process `rank`."""
    lanes, events = _lanes([s for s in tracer.spans if s.track == "comm"]), []
    for span in tracer.spans:
        tid = lanes[id(span)] if span.track == "comm" else TRAINING_THREAD
        events.append(_complete(span, rank, tid))
    for event in tracer.events:
        instant = {"name": event.name, "ph": "i", "s": "t", "ts": event.t_ns / 1000}
        events.append({**instant, "pid": rank, "tid": TRAINING_THREAD, "args": event.args})
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))  # parents before their children
    names = {TRAINING_THREAD: "training thread"}
    names.update({tid: f"collectives {tid}" for tid in sorted(set(lanes.values()))})
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for tid, name in names.items()
    ]
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"rank": rank, "first_step": steps[0], "last_step": steps[1]},
    }


def _complete(span: Span, pid: int, tid: int) -> dict:
    return {
        "name": span.name,
        "cat": span.track,
        "ph": "X",
        "ts": span.start_ns / 1000,
        "dur": (span.end_ns - span.start_ns) / 1000,
        "pid": pid,
        "tid": tid,
        "args": span.args,
    }


def _lanes(spans: list[Span]) -> dict[int, int]:
    """A tid per collective (by id), the lowest whose previous collective has ended, so that
    the spans of one tid never overlap (Perfetto draws overlapping ones badly)."""
    ends: list[int] = []  # per lane, when its last collective ended
    tids = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        lane = next((i for i, end in enumerate(ends) if end <= span.start_ns), len(ends))
        if lane == len(ends):
            ends.append(0)
        ends[lane] = span.end_ns
        tids[id(span)] = TRAINING_THREAD + 1 + lane
    return tids

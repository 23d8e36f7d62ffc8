"""Metrics on disk: one JSON object per line in `metrics.jsonl`, and the trackers' (TensorBoard
event files by default; W&B, MLflow: trackers.py).

Records (one per line, flushed as written so a crash loses nothing):
    {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
     "step_time_s", "elapsed_s", "loss_scale", "skipped_steps", "bytes_sent",
     "rank_step_s": [each rank's work time, [Note: blame] in blame.py], "nonfinite_ranks"}
    {"kind": "val", "step", "val_loss", "tokens", "eval_time_s"}

Each record has a *position* in the file: by step, a step's evaluation before its train
record (the loop evaluates after a step, then reports it). Whoever begins writing (a run's
start, a --resume, a live run's writer taking over: [Note: the writer role] in writer.py)
first cuts the file to the records before its position: a --resume drops what the interrupted
run wrote after its checkpoint, and TensorBoard is told to purge its events from there, so
both show each step once. A line cut short (its writer was killed while writing it) is never
read, and is cut too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .callbacks import Callback
from .ledger import EvalRecord, StepRecord
from .state import TrainState
from .trackers import Trackers

METRICS = "metrics.jsonl"


def position(kind: str, step: int) -> int:
    """The place in metrics.jsonl of the record of `kind` ("train" or "val") at step `step`:
    2 x step, plus 1 for the train record (a step's evaluation comes first)."""
    return 2 * step + (kind == "train")


def position_of(record: dict) -> int:
    """A record's place in metrics.jsonl (`position`)."""
    return position(record["kind"], record["step"])


def after_step(step: int) -> int:
    """The position after step `step`'s records (its evaluation and its train record)."""
    return 2 * step + 2


def start_position(state: TrainState) -> int:
    """Where a writer beginning at `state`'s start writes next: after its step, or at 0 before
    the first evaluation."""
    return after_step(state.step) if state.step or state.ledger.evals else 0


def train_line(record: StepRecord) -> dict:
    return {"kind": "train", **dataclasses.asdict(record), "tokens_per_s": record.tokens_per_s}


def val_line(record: EvalRecord) -> dict:
    return {"kind": "val", **dataclasses.asdict(record)}


def read_metrics(run_dir: Path) -> list[dict]:
    """Every complete record of a run's metrics.jsonl, in order (an empty list when there is
    none): the reading stops at a line without its newline (its writer was killed while
    writing it) or one that is not JSON."""
    path = Path(run_dir) / METRICS
    records = []
    if not path.exists():
        return records
    with open(path, "rb") as handle:
        for line in handle:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("cut short")
                if line.strip():
                    records.append(json.loads(line))
            except ValueError:
                break
    return records


def cut_metrics(run_dir: Path, upto: int) -> list[dict]:
    """Keep only the complete records before position `upto` in metrics.jsonl, and return
    them. The file is always replaced (written aside, then renamed), even when nothing goes:
    a writer left out of the run (stalled, killed only later) that still holds the old file
    open appends to a file nobody reads ([Note: the writer role] in writer.py)."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    kept = [r for r in read_metrics(run_dir) if position_of(r) < upto]
    aside = path.with_name(METRICS + ".tmp")
    with open(aside, "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(aside, path)
    return kept


class MetricsLogger(Callback):
    """Writes every step and evaluation to metrics.jsonl and the trackers `--report-to` names
    (the run's writer only: [Note: the writer role] in writer.py, [Note: trackers] in
    trackers.py).

    run_dir: the run directory.
    trackers: the backends' names (trackers.BACKENDS): TensorBoard's events under
        run_dir/tensorboard by default.
    every: steps between the train scalars the trackers get ([Note: the trackers' cadence]).
    """

    def __init__(
        self, run_dir: Path, *, trackers: tuple[str, ...] = ("tensorboard",), every: int = 1
    ):
        self.run_dir = Path(run_dir)
        self.trackers = Trackers(trackers, self.run_dir, every)
        self.handle = None

    def on_start(self, state: TrainState) -> None:
        self.open(state, start_position(state))

    def open(self, state: TrainState, upto: int) -> None:
        """Begin writing at position `upto`: cut the file to the records before it, then write
        those before it that this process remembers (the session's records in `state.ledger`)
        and the file lacks: what a lost writer had no time to write."""
        kept = cut_metrics(self.run_dir, upto)
        last = max(map(position_of, kept), default=-1)
        remembered = [train_line(r) for r in state.ledger.history] + [
            val_line(r) for r in state.ledger.evals
        ]
        lost = sorted((r for r in remembered if last < position_of(r) < upto), key=position_of)
        self.handle = open(self.run_dir / METRICS, "a", buffering=1)  # line-buffered
        purge = (last + 1) // 2  # the first step not wholly kept: TensorBoard's events purged
        self.trackers.start(state.config, purge_step=purge)
        for record in kept:
            if record["step"] >= purge:  # a kept evaluation of that step
                self.trackers.log_record(record)
        for record in lost:
            self._write(record)

    def _write(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.trackers.log_record(record)

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        self._write(train_line(record))

    def on_eval(self, state: TrainState, record: EvalRecord) -> None:
        self._write(val_line(record))

    def on_end(self, state: TrainState) -> None:
        self.close()

    def close(self, *, keep_trackers: bool = False) -> None:
        """Stop writing: the run ended, or the writer role moved to another process.
        keep_trackers: the file only; the trackers stay open for the report's plots
        (RecordsWriter.report)."""
        if not keep_trackers:
            self.trackers.finish()
        if self.handle:
            self.handle.close()
            self.handle = None

"""Metrics on disk: one JSON object per line in `metrics.jsonl`, and TensorBoard event files.

Records (one per line, flushed as written so a crash loses nothing):
    {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
     "step_time_s", "elapsed_s", "loss_scale", "skipped_steps", "bytes_sent",
     "rank_step_s": [each rank's work time, [Note: blame] in blame.py], "nonfinite_ranks"}
    {"kind": "val", "step", "val_loss", "tokens", "eval_time_s"}

On --resume the lines after the checkpoint's step (written by the interrupted run after its
last checkpoint) are dropped first, and TensorBoard is told to purge its events after that
step, so both show each step once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .loop import Callback
from .trainer import EvalRecord, StepRecord, TrainState

METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl (an empty list when there is none)."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep only the records of steps <= last_step."""
    kept = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    with open(Path(run_dir) / METRICS, "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in kept)


class MetricsLogger(Callback):
    """Writes every step and evaluation to metrics.jsonl and TensorBoard (rank 0 only).

    run_dir: the run directory.
    tensorboard: also write TensorBoard events under run_dir/tensorboard.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.tensorboard = tensorboard
        self.writer = None
        self.handle = None

    def on_start(self, state: TrainState) -> None:
        if (self.run_dir / METRICS).exists():  # a resume, or a restart before any checkpoint
            truncate_metrics(self.run_dir, state.step if state.step else -1)
        self.handle = open(self.run_dir / METRICS, "a", buffering=1)  # line-buffered
        if self.tensorboard:
            # Imported here: TensorBoard's import takes a second, and only rank 0 needs it.
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                str(self.run_dir / TENSORBOARD), purge_step=state.step + 1 if state.step else None
            )

    def _write(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        self._write(
            {"kind": "train", **dataclasses.asdict(record), "tokens_per_s": record.tokens_per_s}
        )
        if self.writer:
            self.writer.add_scalar("train/loss", record.loss, record.step)
            self.writer.add_scalar("train/lr", record.lr, record.step)
            self.writer.add_scalar("train/grad_norm", record.grad_norm, record.step)
            self.writer.add_scalar("perf/tokens_per_s", record.tokens_per_s, record.step)

    def on_eval(self, state: TrainState, record: EvalRecord) -> None:
        self._write({"kind": "val", **dataclasses.asdict(record)})
        if self.writer:
            self.writer.add_scalar("val/loss", record.val_loss, record.step)

    def on_end(self, state: TrainState) -> None:
        if self.writer:
            self.writer.close()
        if self.handle:
            self.handle.close()

"""What a run writes: metrics (and their truncation on resume), checkpoints, the report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dataparallel.train.metrics import MetricsLogger, read_metrics
from dataparallel.train.progress import format_count, format_duration
from dataparallel.train.report import make_report
from dataparallel.train.trainer import EvalRecord, StepRecord


def _step(step: int, loss: float) -> StepRecord:
    return StepRecord(
        step=step, loss=loss, lr=1e-3, grad_norm=0.5, tokens=64, step_time_s=0.5, elapsed_s=step
    )


def _session(run_dir, start: int, stop: int, loss_offset: float = 0.0) -> None:
    """A training session of the logger alone: steps start+1..stop, a validation every 4."""
    state = SimpleNamespace(step=start)
    logger = MetricsLogger(run_dir)
    logger.on_start(state)
    for step in range(start + 1, stop + 1):
        logger.on_step(state, _step(step, 5.0 - 0.1 * step + loss_offset))
        if step % 4 == 0:
            logger.on_eval(state, EvalRecord(step=step, val_loss=4.0, tokens=32, eval_time_s=0.1))
    logger.on_end(state)


def test_resume_drops_what_followed_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _session(tmp_path, 0, 10, loss_offset=1.0)  # crashed after step 10, checkpoint at 6
    _session(tmp_path, 6, 12)  # resumed from the checkpoint at step 6
    records = read_metrics(tmp_path)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert [r["loss"] for r in train[6:]] == pytest.approx([5.0 - 0.1 * s for s in range(7, 13)])
    assert [r["step"] for r in records if r["kind"] == "val"] == [4, 8, 12]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in losses] == list(range(1, 13))
    assert losses[7][1] == pytest.approx(5.0 - 0.8)  # the resumed session's value


def test_report_summarizes_the_metrics(tmp_path):
    _session(tmp_path, 0, 12)
    (tmp_path / "run.json").write_text(json.dumps({"steps": 20, "threads": 1, "parameters": 10}))
    text = make_report(tmp_path)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert (summary["steps_done"], summary["steps_total"], summary["tokens_seen"]) == (12, 20, 768)
    assert summary["final_train_loss_mean"] == pytest.approx(5.0 - 0.1 * 7.5)
    assert summary["train_time_s"] == pytest.approx(6.0)
    assert "stopped at step 12 of 20" in text and f"--resume {tmp_path}" in text
    for name in ("loss.png", "throughput.png"):
        assert (tmp_path / "report" / name).read_bytes()[:4] == b"\x89PNG"


def test_formats():
    assert [format_duration(s) for s in (0.84, 42, 185, 3720)] == ["0.8s", "42s", "3m05s", "1h02m"]
    assert [format_count(n) for n in (789, 12345, 4_560_000)] == ["789", "12.3k", "4.56M"]

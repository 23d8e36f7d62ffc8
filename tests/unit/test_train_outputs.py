"""What a run writes: metrics (and their truncation on resume), checkpoints, the report, and
who writes them when a live run's membership changes."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from dataparallel.train.config import RunConfig
from dataparallel.train.console import format_count, format_duration
from dataparallel.train.metrics import (
    MetricsLogger,
    after_step,
    cut_metrics,
    position,
    read_metrics,
)
from dataparallel.train.report import make_report
from dataparallel.train.trainer import EvalRecord, StepRecord
from dataparallel.train.writer import RecordsWriter, Role


def _step(step: int, loss: float) -> StepRecord:
    return StepRecord(
        step=step, loss=loss, lr=1e-3, grad_norm=0.5, tokens=64, step_time_s=0.5, elapsed_s=step
    )


def _session(run_dir, start: int, stop: int, loss_offset: float = 0.0) -> None:
    """A training session of the logger alone: steps start+1..stop, a validation every 4."""
    ledger = SimpleNamespace(history=[], evals=[])
    state = SimpleNamespace(step=start, ledger=ledger, config=RunConfig())
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


def test_a_machine_whose_matplotlib_cannot_start_still_gets_the_summary(tmp_path, monkeypatch):
    # The GPU machine's matplotlib failed in its font cache (`fc-list`); an ImportError stands in.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _session(tmp_path, 0, 12)
    (tmp_path / "run.json").write_text(json.dumps({"steps": 12, "threads": 1, "parameters": 10}))
    text = make_report(tmp_path)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["steps_done"] == 12 and summary["plots_skipped"].startswith("matplotlib failed")
    assert "report/summary.txt (no plots: matplotlib failed: ModuleNotFoundError" in text
    assert not (tmp_path / "report" / "loss.png").exists()


def test_formats():
    assert [format_duration(s) for s in (0.84, 42, 185, 3720)] == ["0.8s", "42s", "3m05s", "1h02m"]
    assert [format_count(n) for n in (789, 12345, 4_560_000)] == ["789", "12.3k", "4.56M"]


def _lines(run_dir) -> list[tuple[str, int]]:
    return [(r["kind"], r["step"]) for r in read_metrics(run_dir)]


def test_a_line_cut_short_is_not_read_and_is_cut_when_writing_begins(tmp_path):
    _session(tmp_path, 0, 3)
    with open(tmp_path / "metrics.jsonl", "a") as handle:  # a writer killed while writing
        handle.write('{"kind": "train", "step": 4, "lo')
    assert _lines(tmp_path) == [("train", 1), ("train", 2), ("train", 3)]
    assert cut_metrics(tmp_path, position("train", 4)) == read_metrics(tmp_path)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("}\n") and text.count("\n") == 3
    assert [position("val", 4), position("train", 4), after_step(4)] == [8, 9, 10]


def _state(main: bool, step: int, history: list, evals: list = ()) -> SimpleNamespace:
    return SimpleNamespace(
        world=SimpleNamespace(is_main=main),
        step=step,
        ledger=SimpleNamespace(history=history[:step], evals=[e for e in evals if e.step <= step]),
        config=RunConfig().replace(train={"steps": 8}),
        last_step=8,
    )


def test_the_writer_role_moves_to_the_new_rank_0_and_back(tmp_path):
    """Slot 0 (a) writes steps 1-3 and dies while writing step 4's records; slot 1 (b), rank 0
    once the survivors regroup after step 4, writes what was lost, then steps 5 and 6; slot 0's
    replacement (c), let in at step 6, takes the role back ([Note: the writer role])."""
    history = [_step(s, 5.0 - 0.1 * s) for s in range(1, 9)]
    evals = [EvalRecord(step=4, val_loss=4.0, tokens=32, eval_time_s=0.1)]
    a, b = (RecordsWriter(tmp_path, {"steps": 8}, log_every=100, threads=1) for _ in "ab")
    c = RecordsWriter(tmp_path, None, log_every=100, threads=1)  # a replacement: no run.json
    for s in range(1, 4):
        a.on_step(_state(True, s, history, evals), history[s - 1])
        b.on_step(_state(False, s, history, evals), history[s - 1])
    with open(tmp_path / "metrics.jsonl", "a") as handle:  # a dies writing step 4's records
        handle.write('{"kind": "val", "step": 4, "val_')
    b.on_eval(_state(False, 4, history, evals), evals[0])  # all of step 4 done in generation 0
    b.on_step(_state(False, 4, history, evals), history[3])
    assert b.role is Role.WAITING and _lines(tmp_path)[-1] == ("train", 3)
    for s in (5, 6):  # generation 1: b is rank 0
        b.on_step(_state(True, s, history, evals), history[s - 1])
    assert b.role is Role.WRITING and json.loads((tmp_path / "run.json").read_text()) == {
        "steps": 8
    }
    for s in (7, 8):  # generation 2: c is rank 0 again
        c.on_step(_state(True, s, history, evals), history[s - 1])
        b.on_step(_state(False, s, history, evals), history[s - 1])
    assert b.role is Role.WAITING and b.metrics.handle is None
    for writer in (b, c):
        writer.on_end(_state(writer is c, 8, history, evals))
    expected = [("train", s) for s in (1, 2, 3)] + [("val", 4)]
    assert _lines(tmp_path) == expected + [("train", s) for s in range(4, 9)]
    assert [r["loss"] for r in read_metrics(tmp_path)[4:]] == pytest.approx(
        [4.6, 4.5, 4.4, 4.3, 4.2]
    )


def test_a_writer_ahead_of_the_survivors_has_its_records_of_the_redone_step_replaced(tmp_path):
    """Slot 0 finished step 4 and wrote it before dying; the survivors' step 4 failed, so
    they redo it: the new writer's record of it replaces the lost writer's."""
    ahead = [_step(s, 9.0) for s in range(1, 5)]
    redone = [_step(s, 5.0) for s in range(1, 5)]
    a = RecordsWriter(tmp_path, None, log_every=100, threads=1)
    b = RecordsWriter(tmp_path, None, log_every=100, threads=1)
    for s in range(1, 5):
        a.on_step(_state(True, s, ahead), ahead[s - 1])
    b.on_step(_state(True, 4, redone), redone[3])
    b.on_end(_state(True, 4, redone))
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 9.0), (2, 9.0), (3, 9.0), (4, 5.0)
    ]  # fmt: skip

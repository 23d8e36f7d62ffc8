"""The run's ledger ([Note: the ledger] in train/ledger.py): its state dict's round trip, a
rewind that keeps the clock, and checkpoints of the layout before it, which still resume."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dataparallel.data.stream import SampleStream
from dataparallel.train.ledger import EvalRecord, Ledger

TEXT = (b"def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 40)[:1500]


def _ledger() -> Ledger:
    ledger = Ledger(samples=SampleStream(100, seed=7, consumed=36), step=3, skipped_steps=2)
    ledger.consecutive_skips = 1
    ledger.evals = [
        EvalRecord(step=s, val_loss=5.0 - s, tokens=80, eval_time_s=0.1) for s in (0, 2)
    ]
    ledger.fit_started = time.perf_counter() - 40.0
    return ledger


def test_the_state_dict_round_trips_through_json():
    saved = json.loads(json.dumps(_ledger().state_dict()))  # what a checkpoint writes
    expected = torch.rand(4)  # the draws that follow the save
    torch.rand(100)
    ledger = Ledger(samples=SampleStream(100, seed=7))
    ledger.load_state_dict(saved)
    assert (ledger.step, ledger.skipped_steps, ledger.consecutive_skips) == (3, 2, 1)
    assert ledger.samples.consumed == 36
    assert torch.equal(torch.rand(4), expected)  # the random state came back
    assert ledger.evals == [EvalRecord(step=2, val_loss=3.0, tokens=80, eval_time_s=0.1)]
    assert 40.0 <= ledger.elapsed() < 50.0  # the clock goes on from the saved elapsed time
    assert sorted(saved) == [
        "consecutive_skips", "cuda_rng", "elapsed_s", "evals", "rng", "samples", "skipped_steps", "step",
    ]  # fmt: skip


def test_a_rewind_goes_back_in_steps_not_in_time():
    ledger = _ledger()
    saved = ledger.state_dict()
    started = ledger.fit_started
    ledger.samples.take_share(12, 0, 3)
    ledger.step, ledger.consecutive_skips = 5, 0
    ledger.evals.append(EvalRecord(step=4, val_loss=1.0, tokens=80, eval_time_s=0.1))
    ledger.rewind(saved)
    assert (ledger.step, ledger.consecutive_skips, ledger.samples.consumed) == (3, 1, 36)
    assert [r.step for r in ledger.evals] == [0, 2]  # the records after step 3 are cut
    assert ledger.fit_started == started


def test_a_ledger_of_other_data_is_refused_in_one_line():
    saved = _ledger().state_dict()
    with pytest.raises(ValueError, match="seed=7, this run's 8; resume with the same data"):
        Ledger(samples=SampleStream(100, seed=8)).load_state_dict(saved)

"""The benchmark's statistics (benchmarks/step_stats.py, step_stats.py's): pure arithmetic, no
process group. The file is loaded by its path: benchmarks/ stays off sys.path."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

STATS = Path(__file__).resolve().parents[2] / "benchmarks" / "step_stats.py"
_spec = importlib.util.spec_from_file_location("step_stats", STATS)
step_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_stats)
PEERS = {"ddp": ["torch-ddp"]}  # contenders.PEERS's form


def result(times):
    memory = {"params": 1, "grads": 2, "optimizer_state": 3}
    return {"times": times, "cpu_times": times, "loss": 1.0, "memory_per_rank": [memory]}


def test_paired_ratio_is_the_median_of_step_by_step_ratios():
    # The machine slows down half-way: every contender's steps double together. The ratio of
    # medians mixes the two halves; the paired ratio sees 1.1 at every step.
    bound = [1.0, 1.0, 1.0, 2.0, 2.0]
    ours = [1.1, 1.1, 1.1, 2.2, 2.2]
    results = {"bound": result(bound), "ddp": result(ours)}
    assert step_stats.paired_ratio(results, "ddp", "bound") == pytest.approx(1.1)
    assert step_stats.paired_ratio(results, "bound", "bound") == pytest.approx(1.0)


def test_paired_ratio_needs_the_same_steps():
    results = {"bound": result([1.0, 2.0]), "ddp": result([1.0])}
    assert step_stats.paired_ratio(results, "ddp", "bound") is None


def test_summarize_reports_both_ratios_and_the_pairs():
    results = {
        "bound": result([1.0, 1.0, 2.0]),
        "ddp": result([1.2, 1.2, 2.4]),
        "torch-ddp": result([1.5, 1.5, 3.0]),
    }
    args = SimpleNamespace(nproc=2, batch=4, seq=256)
    summary = step_stats.summarize(results, args, PEERS)
    rows = summary["rows"]
    assert rows["ddp"]["vs_bound"] == pytest.approx(1.2)
    assert rows["ddp"]["vs_bound_paired"] == pytest.approx(1.2)
    (pair,) = summary["pairs"]
    assert (pair["ours"], pair["peer"]) == ("ddp", "torch-ddp")
    assert pair["ratio"] == pytest.approx(0.8) and pair["paired"] == pytest.approx(0.8)
    assert summary["tokens_per_step"] == 2 * 4 * 256


def test_work_in_flight_is_finished_before_another_contender_runs():
    # Step interleaving: a step finishes unless the rotation runs the same contender next.
    by_step = [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert step_stats.finish_flags(by_step) == [True, False, True, True]
    # Round interleaving: only each contender's last step finishes; the others overlap.
    by_round = [(0, "a"), (1, "a"), (2, "a"), (0, "b"), (1, "b")]
    assert step_stats.finish_flags(by_round) == [False, False, True, False, True]

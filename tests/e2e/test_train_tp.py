"""`dataparallel train --tp T` (docs/core.md, "Hybrid parallelism"): the same math as data
parallelism alone, and a checkpoint that moves between tensor-parallel sizes.

One run of 4 ranks as dp 2 x tp 2 (ZeRO-3 over "dp", the GPT's heads and MLP split over "tp")
stops after 2 of 4 steps and is resumed on 2 ranks as dp 2 x tp 1 (ZeRO-2); its train and
validation losses are checked against one uninterrupted run of data parallelism alone with the
same global batch, trained on one rank (--batch 4: the same windows in the same steps as dp 2 x
2, one process fewer to start). Measured: equal to the printed digits; checked to 1e-5
relative (tensor parallelism adds its partial sums in another order). A second pair of runs
checks local SGD over it (its reference needs dp 2: the replicas differ between averages). bf16 parameters, compression and averagers over tensor parallelism are checked in the
library (tests/dist/test_tp.py); bad --tp values are in test_train_errors.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from .helpers import CORPUS, cli

ARGS = [
    "--threads", "1",
    "--model", "gpt-tiny",
    "--block-size", "32",
    "--batch", "2",
    "--steps", "4",
    "--lr", "3e-3",
    "--warmup-steps", "1",
    "--eval-every", "2",
    "--eval-windows", "7",
    "--checkpoint-every", "2",
    "--log-every", "1",
    "--seed", "1",
]  # fmt: skip


def _train(args: list[str]) -> subprocess.CompletedProcess:
    result = cli(["train", *args], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(run_dir) -> dict[tuple[str, int], float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        (r["kind"], r["step"]): r["loss"] if r["kind"] == "train" else r["val_loss"]
        for r in records
        if r["kind"] in ("train", "val")
    }


def test_tp_matches_dp_alone_and_resumes_at_another_tp(tmp_path):
    data = ["--data", str(CORPUS)]
    alone, split = tmp_path / "dp1", tmp_path / "dp2xtp2"
    one_rank = ["--nproc", "1", "--batch", "4"]  # the global batch of dp 2 x --batch 2
    _train([*data, *ARGS, *one_rank, "--strategy", "zero2", "--out", str(alone)])
    first = _train(
        [*data, *ARGS, "--nproc", "4", "--tp", "2", "--strategy", "zero3", "--stop-after", "2",
         "--out", str(split)]
    )  # fmt: skip
    assert "world   4 = dp 2 x tp 2 (zero3" in first.stdout
    assert "x 2 dp ranks = 4 windows" in first.stdout
    info = json.loads((split / "run.json").read_text())
    assert (info["world_size"], info["tp"], info["global_batch"]) == (4, 2, 4)
    assert info["parameters"] == json.loads((alone / "run.json").read_text())["parameters"]
    resumed = _train(["--resume", str(split), "--nproc", "2", "--tp", "1", "--strategy", "zero2"])
    assert "resumed at step 2 of 4" in resumed.stdout
    want, got = _losses(alone), _losses(split)
    assert sorted(got) == sorted(want)
    for key, loss in want.items():
        assert got[key] == pytest.approx(loss, rel=1e-5), key


def test_local_sgd_over_tp_resumes_at_another_tp(tmp_path):
    """Local SGD averages the dp replicas (each a tp row) every 2 steps; stopped at step 3, when
    the replicas differ, and resumed at --tp 1, its losses are dp 2 alone's (measured 5.3e-8
    relative): each replica's checkpoint is named by its dp coordinate."""
    flags = [*ARGS, "--data", str(CORPUS), "--local-sgd", "2", "--strategy", "ddp"]
    alone, split = tmp_path / "dp2", tmp_path / "dp2xtp2"
    _train([*flags, "--nproc", "2", "--out", str(alone)])
    _train([*flags, "--nproc", "4", "--tp", "2", "--stop-after", "3", "--out", str(split)])
    resumed = _train(["--resume", str(split), "--nproc", "2", "--tp", "1"])
    assert "resumed at step 3 of 4" in resumed.stdout
    want, got = _losses(alone), _losses(split)
    assert sorted(got) == sorted(want)
    for key, loss in want.items():
        assert got[key] == pytest.approx(loss, rel=1e-5), key

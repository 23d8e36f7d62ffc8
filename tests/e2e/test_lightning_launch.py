"""A Lightning script on DataParallelStrategy, started the ways users start it: `python
script.py` with devices=2 (Lightning's own launcher makes the second process) and under
`dataparallel launch --nproc 2` (the processes made outside, read by Lightning's cluster
environment). Both train the same weights, bit for bit, and the loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import cli

pytest.importorskip("lightning")

SCRIPT = Path(__file__).parent / "scripts" / "lightning_fit.py"


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.ckpt", weights_only=True)["state_dict"]


def test_lightnings_launcher_and_ours_train_the_same_weights(tmp_path):
    own, ours = tmp_path / "own", tmp_path / "ours"
    own.mkdir(), ours.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), str(own), "zero2", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    launched = cli(
        ["launch", "--nproc", "2", "--threads", "1", str(SCRIPT), str(ours), "zero2", "2"]
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    results = [json.loads((out / "result.json").read_text()) for out in (own, ours)]
    for result in results:
        assert result["world_size"] == 2 and result["ranks"] == 2
        assert result["last"] < result["first"] - 0.05  # random tokens: the unigrams only
    a, b = _weights(own), _weights(ours)
    assert sorted(a) == sorted(b) and len(a) > 10
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0

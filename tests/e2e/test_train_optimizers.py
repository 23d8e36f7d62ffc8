"""`dataparallel train --optimizer muon|adafactor` end to end: 2 workers, gpt-tiny, 4 steps.

- Muon + AdamW under DDP and ZeRO-3 end on the same curve (to 1e-5 relative: the owners' update
  is torch's, [Note: optimizer layout]); under ZeRO-2 --stop-after 2 then --resume ends on the
  uninterrupted run's curve and weights bit for bit;
- Adafactor under DDP and ZeRO-3 the same (its factored moments on whole matrices);
  each DDP run stops after 2 steps and resumes from its checkpoint (Adafactor's factored
  state in its own shapes);
- an hf: model trains with Muon and its loss falls.
The header and run.json name the optimizer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .helpers import TINY, cli, curve, train

os.environ["HF_HUB_OFFLINE"] = "1"
ARGS = [
    *TINY,
    "--accum", "2",
    "--steps", "4",
    "--lr", "3e-3",
    "--warmup-steps", "1",
    "--val-fraction", "0.1",
    "--eval-every", "0",
    "--eval-windows", "7",
]  # fmt: skip


def _run(args: list[str], out: Path):
    result = train(args, out)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel) for k in a)


def _resume(out: Path) -> subprocess.CompletedProcess:
    result = cli(["train", "--resume", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_ddp_and_zero3_train_the_same_curve(optimizer, tmp_path):
    """ZeRO-3 straight through; DDP stopped after 2 steps and resumed from its checkpoint
    (Adafactor's factored moments stored in their own shapes)."""
    zero3 = _run([*ARGS, "--optimizer", optimizer, "--strategy", "zero3"], tmp_path / "zero3")
    assert f"optim   {optimizer}, lr peak 0.003" in zero3.stdout
    ddp = [*ARGS, "--optimizer", optimizer, "--strategy", "ddp", "--stop-after", "2"]
    _run(ddp, tmp_path / "ddp")
    assert "resumed at step 2 of 4" in _resume(tmp_path / "ddp").stdout
    runs = {name: curve(tmp_path / name)["train_loss"] for name in ("ddp", "zero3")}
    assert json.loads((tmp_path / "ddp" / "run.json").read_text())["optimizer"] == optimizer
    assert len(runs["ddp"]) == 4
    assert runs["ddp"][4] < runs["ddp"][1]
    assert _close(runs["ddp"], runs["zero3"], 1e-5)


def test_a_resumed_muon_run_ends_where_the_uninterrupted_one_ends(tmp_path):
    args = [*ARGS, "--optimizer", "muon", "--strategy", "zero2"]
    _run(args, tmp_path / "whole")
    first = _run([*args, "--stop-after", "2"], tmp_path / "halves")
    assert "stopped at step 2 of 4" in first.stdout
    assert "resumed at step 2 of 4" in _resume(tmp_path / "halves").stdout
    assert curve(tmp_path / "halves") == curve(tmp_path / "whole")  # exact
    weights = load_file(str(tmp_path / "halves" / "model.safetensors"))
    expected = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_an_hf_model_trains_with_muon(tiny_llama, tmp_path):
    llama = tiny_llama  # make_tiny_llama(layers=2, width=32), built once a session (conftest.py)
    args = [*ARGS[:4], "--model", f"hf:{llama}", "--block-size", "32", "--batch", "4"]
    args += ["--steps", "4", "--lr", "1e-2", "--warmup-steps", "1", "--eval-every", "0"]
    result = _run([*args, "--optimizer", "muon", "--strategy", "zero3"], tmp_path / "run")
    assert "optim   muon" in result.stdout
    losses = curve(tmp_path / "run")["train_loss"]
    assert len(losses) == 4 and losses[4] < losses[1]

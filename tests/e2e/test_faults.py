"""Faults, end to end through the CLI: a killed worker or launcher loses nothing, a checkpoint
resumes on another world size and strategy, and damaged or foreign checkpoints are refused
with one line while the previous one stays usable (docs/faults.md).

The 20-trial figure comes from benchmarks/kill_trials.py; here one trial of each kind runs
(tests/killed_runs.py, the trial they share).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import killed_runs
import pytest
import torch
from safetensors.torch import load_file

from .helpers import CORPUS, REFERENCE_ARGS, cli, ok, train


def _resume(run_dir: Path, *flags: str):
    return cli(["train", "--resume", str(run_dir), *flags])


@pytest.fixture(scope="module")
def whole(reference_run) -> Path:
    """The uninterrupted run: test_train_cli's reference run, trained once (conftest.py)."""
    return reference_run[0]


@pytest.fixture(scope="module")
def stopped(six_steps) -> Path:
    """The same run under ZeRO-2, stopped at step 6 (its checkpoint), to resume from (shared
    with test_train_cli through conftest.py: tests here change copies only)."""
    return six_steps("zero2")


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def _weights(run: Path) -> dict:
    return load_file(str(run / "model.safetensors"))


def test_a_resume_on_one_rank_under_ddp_keeps_every_sample(whole, stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    result = _resume(run, "--nproc", "1", "--strategy", "ddp")
    ok(result)
    # The global batch of 2 x 4 x 2 = 16 windows is kept: accum 2 -> 4 on one rank.
    assert "1 ranks x" in result.stdout and "global batch 16 windows" in result.stdout
    latest = run / "checkpoint" / (run / "checkpoint" / "latest").read_text().strip()
    state = json.loads((latest / "train_state.json").read_text())
    assert state["ledger"]["samples"]["consumed"] == 12 * 16  # the same samples as the whole run
    # Sums in another order: Adam turns a rounding difference in a ~0 gradient into a visible
    # part of lr = 3e-3 (tests/unit/test_train_loop.py); 1e-4 is 3% of it (measured: 2.9e-5).
    ours, reference = _weights(run), _weights(whole)
    assert max((ours[k] - reference[k]).abs().max().item() for k in ours) < 1e-4


def test_killing_a_worker_loses_nothing(whole, tmp_path):
    """Worker 0 or 1, killed 0-0.5 s after step 2 is recorded (steps 2-7 of 12, the step-6
    checkpoint among them): the launcher restarts them."""
    rng = random.Random(5)
    args = killed_runs.command(tmp_path / "run", 12, 6)
    args[args.index("--batch") + 1] = "4"
    at_step_2 = lambda out: killed_runs.last_step(out) >= 2  # noqa: E731
    result = _trial_with(args, "worker", tmp_path / "run", whole, rng, at_step_2)
    assert result["ok"] and result["killed"] == "worker", result  # one was killed mid-run


def test_killing_the_launcher_then_resuming_by_hand_loses_nothing(whole, tmp_path):
    """The launcher killed 0-0.5 s after the step-6 checkpoint is committed and step 7 is
    recorded; its workers die with it, and `--resume` by hand ends on the whole run."""
    rng = random.Random(6)
    args = killed_runs.command(tmp_path / "run", 12, 6)

    def after_the_checkpoint(out):
        return (out / "checkpoint" / "latest").exists() and killed_runs.last_step(out) >= 7

    result = _trial_with(args, "launcher", tmp_path / "run", whole, rng, after_the_checkpoint)
    assert result["ok"] and result["killed"] == "launcher", result
    assert result["resumed_by_hand"], result  # killed before the run's end, then resumed


def _trial_with(args, kind, out, whole, rng, when):
    """killed_runs.trial with the reference run's flags (CORPUS, REFERENCE_ARGS)."""
    flags = [*REFERENCE_ARGS, "--data", str(CORPUS)]

    def command(out_dir, steps, every, extra=()):
        return [sys.executable, "-m", "dataparallel.cli", "train", *flags, "--out", str(out_dir)]

    original = killed_runs.command
    killed_runs.command = command
    try:
        return killed_runs.trial(kind, out, whole / "model.safetensors", rng.uniform(0, 0.5), rng,
                                 12, 6, when=when)  # fmt: skip
    finally:
        killed_runs.command = original


def _error(result) -> str:
    assert result.returncode == 2, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumes(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    (run / "checkpoint" / "step-000006" / "__1_0.distcp").write_bytes(b"\0" * 100)
    message = _error(_resume(run))
    assert "step-000006/__1_0.distcp is truncated" in message
    assert "no earlier checkpoint is left" in message  # the run stopped at its first
    # A run with two checkpoints: damage the newest, resume from the one before.
    run2 = tmp_path / "run2"
    ok(train([*REFERENCE_ARGS, "--checkpoint-every", "3", "--stop-after", "6"], run2))
    data = run2 / "checkpoint" / "step-000006" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    message = _error(_resume(run2))
    assert "__0_0.distcp is corrupted" in message
    assert f"--resume {run2 / 'checkpoint' / 'step-000003'}" in message
    ok(_resume(run2 / "checkpoint" / "step-000003"))
    assert json.loads((run2 / "run.json").read_text())["resumed_at"][0]["step"] == 3


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_never_run(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    folder = run / "checkpoint" / "step-000006"
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((folder / "manifest.json").read_text())  # a careful attacker
    manifest[".metadata"]["bytes"] = (folder / ".metadata").stat().st_size
    import zlib

    manifest[".metadata"]["crc32"] = zlib.crc32((folder / ".metadata").read_bytes())
    (folder / "manifest.json").write_text(json.dumps(manifest))
    message = _error(_resume(run))
    assert "cannot be read safely (refusing to load posix.system)" in message
    assert not marker.exists()


def test_a_different_model_is_named_by_its_first_parameter(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    message = _error(_resume(run, "--model", "gpt-small"))
    assert message.startswith("dataparallel train: error: --model (model.name): ")
    assert "'tok_emb.weight' has shape [256, 144] in the checkpoint but [256, 256]" in message


def test_a_resume_on_three_ranks_shares_the_global_batch_unevenly(whole, stopped, tmp_path):
    """16 windows on 3 ranks: 6,5,5 per rank (micro-batches 3+3, 3+2, 3+2), every sample once,
    the weights those of the uninterrupted run up to summation order ([Note: uneven batches])."""
    run = _copy(stopped, tmp_path)
    result = _resume(run, "--nproc", "3", "--strategy", "zero3")
    ok(result)
    assert "global batch 16 = 6,5,5 windows per rank in 2 micro-steps (uneven)" in result.stdout
    latest = run / "checkpoint" / (run / "checkpoint" / "latest").read_text().strip()
    state = json.loads((latest / "train_state.json").read_text())
    assert state["ledger"]["samples"]["consumed"] == 12 * 16 and state["global_batch"] == 16
    ours, reference = _weights(run), _weights(whole)
    assert max((ours[k] - reference[k]).abs().max().item() for k in ours) < 1e-4


def test_exported_weights_equal_the_checkpoint(whole):
    """Every tensor of model.safetensors, tied names included, is the checkpoint's."""
    from dataparallel.checkpoint import Chunk, load_chunks

    weights = _weights(whole)
    latest = whole / "checkpoint" / "step-000012"
    stored = json.loads((latest / "train_state.json").read_text())["weights"]
    assert sorted(name for name, _ in stored) == sorted(weights)
    assert any(key != f"model/{name}" and key.startswith("model/") for name, key in stored)
    for name, key in stored:
        value = torch.empty(weights[name].numel(), dtype=weights[name].dtype)
        load_chunks({key: Chunk(value)}, latest, None)
        assert torch.equal(value.view_as(weights[name]), weights[name]), name

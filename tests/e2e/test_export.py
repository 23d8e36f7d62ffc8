"""`dataparallel export RUN_OR_CHECKPOINT --out DIR` end to end: the weights of an intermediate
checkpoint equal those of a run stopped at that step, bit for bit; a run directory exports its
latest checkpoint (the final weights); an hf:DIR run's export is a save_pretrained directory
that transformers loads; bad input is one line with exit status 2."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hf_fixtures import make_tiny_llama
from safetensors.torch import load_file

from dataparallel.checkpoint import read_weights_metadata
from dataparallel.cli import main

from .helpers import TINY, train

os.environ["HF_HUB_OFFLINE"] = "1"  # the tests never reach the network
ARGS = [
    *TINY,
    "--steps", "8",
    "--lr", "3e-3",
    "--warmup-steps", "2",
    "--eval-every", "0",
    "--checkpoint-every", "4",
    "--strategy", "zero3",
]  # fmt: skip


def _check(result):
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run of 8 steps that checkpoints at 4 and 8, and the same run stopped after step 4."""
    root = tmp_path_factory.mktemp("export")
    _check(train(ARGS, root / "whole"))
    _check(train([*ARGS, "--stop-after", "4"], root / "stopped"))
    return root / "whole", root / "stopped"


def test_an_intermediate_checkpoint_exports_the_weights_of_its_step(runs, tmp_path, capsys):
    whole, stopped = runs
    step4 = whole / "checkpoint" / "step-000004"
    assert main(["export", str(step4), "--out", str(tmp_path / "at4")]) == 0
    assert capsys.readouterr().out.strip() == f"exported {step4} to {tmp_path / 'at4'}"
    exported = load_file(tmp_path / "at4" / "model.safetensors")
    assert _equal(exported, load_file(stopped / "model.safetensors"))
    assert not _equal(exported, load_file(whole / "model.safetensors"))
    assert read_weights_metadata(tmp_path / "at4" / "model.safetensors")["step"] == 4
    # A run directory: its latest checkpoint, the run's own final weights.
    assert main(["export", str(whole), "--out", str(tmp_path / "last")]) == 0
    assert _equal(
        load_file(tmp_path / "last" / "model.safetensors"), load_file(whole / "model.safetensors")
    )


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    whole, _ = runs
    damaged = tmp_path / "damaged"
    shutil.copytree(whole, damaged)
    data = next((damaged / "checkpoint" / "step-000008").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    half = tmp_path / "half" / "checkpoint" / "step-000004"
    half.mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "nowhere"): "is no run directory or checkpoint folder",
        str(tmp_path / "empty"): "has no complete checkpoint under checkpoint/",
        str(half): "is not a complete checkpoint (it has no manifest.json)",
        str(damaged): "is truncated; the previous checkpoint is intact",
    }
    for given, expected in cases.items():
        assert main(["export", given, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dataparallel export: error: "), err
        assert expected in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert len(cases) == 4


def test_an_hf_run_exports_a_save_pretrained_directory_of_any_step(tmp_path_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    llama = make_tiny_llama(tmp_path_factory.mktemp("hf") / "llama", layers=1, width=32)
    run = tmp_path / "run"
    args = [*ARGS, "--model", f"hf:{llama}", "--strategy", "ddp"]
    _check(train(args, run))
    out = tmp_path / "at4"
    assert main(["export", str(run / "checkpoint" / "step-000004"), "--out", str(out)]) == 0
    weights = load_file(out / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    assert _equal({k: loaded[k] for k in weights}, weights)
    assert (out / "hf" / "tokenizer.json").is_file()
    assert not _equal(weights, load_file(run / "model.safetensors"))  # step 4, not the last

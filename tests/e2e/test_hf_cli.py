"""`dataparallel train --model hf:DIR` end to end: a tiny Llama saved here, 2 workers.

Each run's loss falls, RUN/hf loads with `AutoModelForCausalLM.from_pretrained` and holds the
trained weights; DDP and ZeRO-3 (which fills the model unit by unit) end on the same weights;
LoRA leaves the base bit-identical and its export equals base + adapter; a resumed run ends
where the uninterrupted one ends. Bad model fields are one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from dataparallel.cli import main

from .helpers import CORPUS, TWO_RANKS, curve, refused_in_one_line, train

os.environ["HF_HUB_OFFLINE"] = "1"  # the tests never reach the network
ARGS = [
    *TWO_RANKS,
    "--batch", "4",
    "--steps", "8",
    "--lr", "1e-2",
    "--warmup-steps", "2",
    "--eval-every", "4",
    "--eval-windows", "8",
    "--checkpoint-every", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return tiny_llama  # make_tiny_llama(layers=2, width=32), built once a session (conftest.py)


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory):
    """One run per strategy, shared by the tests below."""
    out = {}
    for strategy in ("ddp", "zero3"):
        run = tmp_path_factory.mktemp(strategy) / "run"
        result = train([*ARGS, "--model", f"hf:{llama}", "--strategy", strategy], run)
        assert result.returncode == 0, result.stderr[-3000:]
        out[strategy] = run
    return out


def _check(result):
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


def test_every_strategy_trains_and_exports_a_loadable_model(runs):
    from transformers import AutoModelForCausalLM

    finals = {}
    for strategy, run in runs.items():
        val = curve(run)["val_loss"]
        assert val[8] < val[0] - 0.1, (strategy, val)
        exported = AutoModelForCausalLM.from_pretrained(run / "hf").state_dict()
        trained = load_file(run / "model.safetensors")
        assert sorted(exported) == sorted(trained)
        assert all(torch.equal(exported[k], trained[k]) for k in trained), strategy
        assert (run / "hf" / "tokenizer.json").is_file()
        finals[strategy] = trained
    diff = max((finals["ddp"][k] - finals["zero3"][k]).abs().max().item() for k in finals["ddp"])
    assert diff < 1e-5, diff  # ZeRO-3, filled unit by unit, trains what DDP trains


def test_lora_keeps_the_base_and_exports_merged_weights(llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    lora = "r=4,alpha=8,targets=q_proj,v_proj"
    _check(train([*ARGS, "--model", f"hf:{llama}", "--strategy", "zero2", "--lora", lora], run))
    original = load_file(llama / "model.safetensors")
    trained = load_file(run / "model.safetensors")
    for name, tensor in trained.items():
        if "lora_" not in name:  # the frozen base: bit-identical
            base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(tensor, original[base]), name
    assert max(t.abs().max().item() for n, t in trained.items() if "lora_B" in n) > 0
    merged = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(llama), run / "hf" / "adapter"
    ).eval()
    x = torch.randint(0, merged.config.vocab_size, (2, 16))
    assert (merged(x).logits - with_adapter(x).logits).abs().max().item() < 1e-5
    # Interrupted at step 4 and resumed, it ends on the same adapters and base.
    again = tmp_path / "again"
    args = [*ARGS, "--model", f"hf:{llama}", "--strategy", "zero2", "--lora", lora]
    _check(train([*args, "--stop-after", "4"], again))
    _check(train(["--resume", str(again)], again))
    resumed = load_file(again / "model.safetensors")
    assert all(torch.equal(resumed[k], trained[k]) for k in trained)


def test_random_init_starts_from_the_config_alone(llama, tmp_path):
    run = tmp_path / "run"
    _check(train([*ARGS, "--model", f"hf:{llama}", "--init", "random", "--strategy", "zero1"], run))
    val = curve(run)["val_loss"]
    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    assert abs(val[0] - math.log(vocab)) < 0.1, val  # uniform predictions at the start
    assert val[8] < val[0] - 0.1


def test_resume_ends_where_the_uninterrupted_run_ends(llama, runs, tmp_path):
    run = tmp_path / "run"
    args = [*ARGS, "--model", f"hf:{llama}", "--strategy", "zero3"]
    _check(train([*args, "--stop-after", "4"], run))
    _check(train(["--resume", str(run)], run))
    resumed, whole = (
        load_file(run / "model.safetensors"),
        load_file(runs["zero3"] / "model.safetensors"),
    )
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def _not_a_model(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    return [f"hf:{folder}"]


CASES = {
    "not a directory": (
        lambda tmp, llama: ["--model", f"hf:{tmp}/missing"],
        ["is not a directory"],
    ),
    "no config.json": (
        lambda tmp, llama: ["--model", *_not_a_model(tmp)],
        ["holds no config.json"],
    ),
    "lora on a built-in model": (
        lambda tmp, llama: ["--lora", "r=4"],
        ["--lora (model.lora)", "hf:DIR models only"],
    ),
    "lora targets that match nothing": (
        lambda tmp, llama: ["--model", f"hf:{llama}", "--lora", "r=4,targets=nope"],
        ["--lora (model.lora)", "nope match no linear layer", "q_proj"],
    ),
    "a bad lora spec": (
        lambda tmp, llama: ["--model", f"hf:{llama}", "--lora", "rank=4"],
        ["--lora (model.lora)", "unknown key 'rank'"],
    ),
    "an unknown init": (
        lambda tmp, llama: ["--model", f"hf:{llama}", "--init", "zeros"],
        ["--init (model.init)", "'zeros'"],
    ),
    "a block longer than the model's context": (
        lambda tmp, llama: ["--model", f"hf:{llama}", "--block-size", "512"],
        ["--block-size (data.block_size)", "context of 256"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_model_fields_are_one_line_exit_2_nothing_written(
    name, llama, tmp_path, monkeypatch, capsys
):
    make_args, fragments = CASES[name]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["--data", str(CORPUS), *make_args(tmp_path, llama)]
    refused_in_one_line(args, tmp_path, capsys, fragments)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(llama, tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    for f in llama.iterdir():
        (small / f.name).write_bytes(f.read_bytes())
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 100
    (small / "config.json").write_text(json.dumps(config))
    assert main(["train", "--data", str(CORPUS), "--model", f"hf:{small}", "--init", "random"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer has 384 tokens but the model's vocabulary only 100" in err, err


def test_bf16_params_on_a_2x2_mesh_trains_close_to_fp32(llama, runs, tmp_path):
    """ZeRO-3 over shard groups of 2 on 4 ranks (HSDP) with bf16 parameters and fp32 masters,
    filled unit by unit: it trains as the fp32 run does, to bf16's precision."""
    run = tmp_path / "run"
    args = [*ARGS, "--model", f"hf:{llama}", "--strategy", "zero3", "--precision", "bf16-params"]
    _check(train([*args, "--nproc", "4", "--batch", "2", "--shard-group", "2"], run))
    ours, fp32 = curve(run)["val_loss"], curve(runs["zero3"])["val_loss"]
    assert abs(ours[8] - fp32[8]) < 0.02 * fp32[8], (ours, fp32)

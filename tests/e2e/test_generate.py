"""`dataparallel generate`, `eval` and `sample` on a tiny Llama (built here) and a byte GPT run.

generate with 2 workers on 5 prompts (a count they do not divide; batches of 2, so one rank
runs a stand-in batch) must give, prompt by prompt and in input order, what one process's
greedy `model.generate` gives for each prompt alone, and so must the model sharded by ZeRO-3
(every rank's forwards in step, [Note: forwards in step] in infer/decoding.py). eval's
perplexity must not depend on the number of workers (1e-6) and must equal the mean token
cross-entropy computed here (2 workers under ZeRO-3, one of them scoring a stand-in window).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from dataparallel.cli import main
from dataparallel.models import build_model

from .helpers import CORPUS, cli

sys.path.insert(0, str(Path(__file__).parents[1]))  # hf_fixtures

PROMPTS = [
    "def wrap(text, width",
    "import os",
    "class TextWrapper:",
    "    return",
    "# The quick brown fox jumps over the lazy dog, and then",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return cli(list(args), timeout=180)


def _prompts_file(path: Path, prompts=PROMPTS) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts))
    )
    return path


def _completions(path: Path) -> list[str]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == list(range(len(records)))  # input order, fields kept
    return [r["completion"] for r in records]


@pytest.fixture(scope="module")
def llama(tiny_llama) -> Path:
    return tiny_llama  # make_tiny_llama's defaults, built once a session (conftest.py)


@pytest.fixture(scope="module")
def llama_reference(llama) -> list[str]:
    return greedy_generate(llama)


def greedy_generate(model_dir: Path) -> list[str]:
    """Each prompt alone through transformers' own greedy generate, cut at the eos token."""
    from transformers import AutoModelForCausalLM

    from dataparallel.data.tokenizer import HFTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = HFTokenizer.load(model_dir)
    texts = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
        new = out[0, ids.shape[1] :].tolist()
        if tokenizer.eos_id in new:
            new = new[: new.index(tokenizer.eos_id)]
        texts.append(tokenizer.decode(new))
    return texts


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_generate_equals_greedy_generate_prompt_by_prompt(
    strategy, llama, llama_reference, tmp_path
):
    out = tmp_path / "out.jsonl"
    result = _cli(
        "generate", str(llama), "--prompts", str(_prompts_file(tmp_path / "p.jsonl")),
        "--out", str(out), "--tokens", "12", "--nproc", "2", "--threads", "1",
        "--batch", "2", "--strategy", strategy,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _completions(out) == llama_reference
    assert "5 completions" in result.stdout and "2 workers" in result.stdout


def test_generate_from_a_run_that_holds_an_hf_export(llama, llama_reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(llama, run / "hf")
    out = tmp_path / "out.jsonl"
    prompts = _prompts_file(tmp_path / "p.jsonl")
    args = ["--prompts", str(prompts), "--out", str(out), "--tokens", "12", "--nproc", "1"]
    assert main(["generate", str(run), *args]) == 0
    assert _completions(out) == llama_reference


def test_generate_on_a_gpt2_in_one_process(tmp_path):
    from hf_fixtures import make_tiny_gpt2

    model = make_tiny_gpt2(tmp_path / "gpt2")  # learned positions: the position ids must be right
    out = tmp_path / "out.jsonl"
    prompts = _prompts_file(tmp_path / "p.jsonl")
    args = ["--prompts", str(prompts), "--out", str(out), "--tokens", "12", "--batch", "3"]
    assert main(["generate", str(model), *args, "--nproc", "1", "--threads", "1"]) == 0
    assert _completions(out) == greedy_generate(model)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """A run directory as `dataparallel train` leaves it: model.safetensors with its metadata."""
    run = tmp_path_factory.mktemp("gpt") / "run"
    run.mkdir()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=2, block_size=24)
    weights = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    metadata = {"model": "gpt-tiny", "model_config": asdict(model.config), "step": 0}
    save_file(
        weights, str(run / "model.safetensors"), {k: json.dumps(v) for k, v in metadata.items()}
    )
    return run


def _greedy_bytes(run: Path, prompt: str, tokens: int) -> str:
    from dataparallel.infer.sampling import load_trained_model

    model, _ = load_trained_model(run)
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        for _ in range(tokens):
            next_id = model(ids[:, -24:])[:, -1, :].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return bytes(ids[0, len(prompt.encode()) :].tolist()).decode("utf-8", errors="replace")


def test_generate_on_a_byte_gpt_run(gpt_run, tmp_path):
    # Two prompts of one length share a batch; the longest slides past the 24-byte context.
    prompts = ["abc", "xyz", "def f(x):", "1234567890", "abd"]
    out = tmp_path / "out.jsonl"
    result = _cli(
        "generate", str(gpt_run), "--prompts", str(_prompts_file(tmp_path / "p.jsonl", prompts)),
        "--out", str(out), "--tokens", "20", "--nproc", "2", "--threads", "1", "--batch", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _completions(out) == [_greedy_bytes(gpt_run, p, 20) for p in prompts]


def test_sampling_does_not_depend_on_the_workers(gpt_run, tmp_path):
    prompts = _prompts_file(tmp_path / "p.jsonl")
    outs = []
    for nproc in ("1", "2"):
        out = tmp_path / f"out{nproc}.jsonl"
        result = _cli(
            "generate", str(gpt_run), "--prompts", str(prompts), "--out", str(out),
            "--tokens", "16", "--nproc", nproc, "--threads", "1", "--batch", "3",
            "--temperature", "1.0", "--top-k", "20", "--seed", "5",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        outs.append(_completions(out))
    assert outs[0] == outs[1]
    assert outs[0] != [_greedy_bytes(gpt_run, p, 16) for p in PROMPTS]  # it did sample


def _direct_loss(llama: Path, data: Path, block: int) -> tuple[float, int]:
    """The mean token cross-entropy of the data's windows, in one process, here."""
    from transformers import AutoModelForCausalLM

    from dataparallel.data.tokenizer import HFTokenizer

    tokenizer = HFTokenizer.load(llama)
    model = AutoModelForCausalLM.from_pretrained(llama).eval()
    ids: list[int] = []
    for number, path in enumerate(sorted(p for p in data.iterdir() if not p.name.startswith("."))):
        ids += ([tokenizer.eos_id] if number else []) + tokenizer.encode(path.read_text())
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - block, block):
            window = torch.tensor([ids[start : start + block + 1]])
            logits = model(input_ids=window[:, :-1]).logits
            total += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").double().item()
            count += block
    return total / count, count


def test_eval_is_exact_for_any_number_of_workers(llama, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    text = (CORPUS / "engine_notes.md").read_text()
    (data / "a.md").write_text(text[:3000])  # two documents, an eos token between them
    (data / "b.md").write_text(text[3000:5000])
    results = {}
    for nproc, strategy in [("1", "ddp"), ("2", "zero3")]:  # 2 workers: 27 and 26 windows
        out = tmp_path / f"eval{nproc}.json"
        result = _cli(
            "eval", str(llama), "--data", str(data), "--block", "64", "--batch", "3",
            "--nproc", nproc, "--threads", "1", "--strategy", strategy, "--out", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        results[nproc] = json.loads(out.read_text())
    loss, tokens = _direct_loss(llama, data, 64)
    assert tokens == 53 * 64
    for got in results.values():
        assert (got["tokens"], got["windows"]) == (tokens, 53)
        assert got["loss"] == pytest.approx(loss, rel=1e-6)
        assert got["perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert results["2"]["loss"] == pytest.approx(results["1"]["loss"], rel=1e-6)


def test_sample_on_a_save_pretrained_directory(llama, llama_reference, capsys):
    args = ["sample", str(llama), "--prompt", PROMPTS[0], "--tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    assert capsys.readouterr().out == PROMPTS[0] + llama_reference[0] + "\n"


def _bad_cases(tmp_path: Path, llama: Path) -> dict:
    prompts = _prompts_file(tmp_path / "p.jsonl")
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text('{"prompt": "a"}\nprompt: b\n')
    not_model = tmp_path / "empty_dir"
    not_model.mkdir()
    out = str(tmp_path / "out.jsonl")
    generate = ["generate", str(llama), "--prompts", str(prompts), "--out", out]
    return {
        "not a model": (
            ["generate", str(not_model), "--prompts", str(prompts), "--out", out],
            "RUN_OR_DIR: ", "holds no model (no config.json, hf/config.json or model.safetensors)",
        ),
        "no such model": (["eval", str(tmp_path / "nope"), "--data", str(prompts)], "does not exist"),
        "line without the field": (
            ["generate", str(llama), "--prompts", str(no_field), "--out", out],
            '--prompts: line 2 of', 'has no "prompt" text; give each line',
        ),
        "line not JSON": (
            ["generate", str(llama), "--prompts", str(not_json), "--out", out],
            "--prompts: line 2 of", "is not JSON",
        ),
        "no prompts file": (
            ["generate", str(llama), "--prompts", str(tmp_path / "none.jsonl"), "--out", out],
            "--prompts: ", "is not a file",
        ),
        "out is the prompts": (
            ["generate", str(llama), "--prompts", str(prompts), "--out", str(prompts)],
            "--out: is the prompts file",
        ),
        "out in no folder": (
            ["generate", str(llama), "--prompts", str(prompts), "--out", "/nope/o.jsonl"],
            "--out: /nope does not exist",
        ),
        "tokens": ([*generate, "--tokens", "0"], "--tokens: 0 is below 1; use 1 or more"),
        "past the positions": (  # found once the prompts are tokenized, by every rank alike
            [*generate, "--tokens", "250", "--nproc", "1"],
            "--tokens: the longest prompt (", "and 250 new tokens exceed the model's 256 positions",
        ),
        "strategy": ([*generate, "--strategy", "zero2"], "--strategy: unknown value 'zero2'"),
        "nproc": ([*generate, "--nproc", "0"], "--nproc (launch.nproc): 0 is below 1"),
        "data": (["eval", str(llama), "--data", str(tmp_path / "nope")], "--data: ", "does not exist"),
        "tokenizer larger than the model": (
            ["eval", str(_small_vocab(llama, tmp_path)), "--data", str(prompts)],
            "RUN_OR_DIR: the tokenizer in", "save the tokenizer the model was trained with",
        ),
    }  # fmt: skip


def _small_vocab(llama: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "small_vocab"
    shutil.copytree(llama, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    return copy


def test_bad_input_is_one_line_and_writes_nothing(llama, tmp_path, capsys):
    for name, (args, *fragments) in _bad_cases(tmp_path, llama).items():
        status = main(args)
        err = capsys.readouterr().err
        assert status == 2, name
        command = args[0]
        assert err.startswith(f"dataparallel {command}: error: ") and err.count("\n") == 1, err
        for fragment in fragments:
            assert fragment in err, (name, err)
        assert not (tmp_path / "out.jsonl").exists(), name

"""`dataparallel train --data x.jsonl`, 2 workers: prompt/completion data on the byte model,
chat data on a tiny Llama (`--model hf:DIR`, rendered with its tokenizer's chat template).

The loss counts only completion tokens ([Note: loss masking] in data/packing.py): every step's
token count is replayed here from the same windows and the same sample order, and equals the
completion tokens of the windows trained on.
"""

from __future__ import annotations

import json
import math

from dataparallel.data.loading import load_datasets
from dataparallel.data.packing import IGNORE
from dataparallel.data.stream import SampleStream
from dataparallel.data.tokenizer import ByteTokenizer

from .helpers import TINY, curve, train

ARGS = [
    *TINY,
    "--steps", "12",
    "--lr", "3e-3",
    "--warmup-steps", "3",
    "--val-fraction", "0.1",
    "--eval-every", "6",
    "--eval-windows", "8",
    "--checkpoint-every", "0",
    "--seed", "1",
]  # fmt: skip


def _pairs() -> list[dict]:
    return [
        {"prompt": f"Q: what is {a} plus {b}?\nA:", "completion": f" {a + b}\n"}
        for a in range(12)
        for b in range(12)
    ]


def test_prompt_completion_jsonl_trains_on_completion_tokens_only(tmp_path):
    data = tmp_path / "sums.jsonl"
    records = _pairs()
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = train(ARGS, tmp_path / "run", data=data)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]  # a busy machine may
    assert [line for line in lines if "is a straggler" not in line] == []  # name a straggler
    losses = curve(tmp_path / "run")
    assert losses["val_loss"][0] > math.log(256) - 0.5  # untrained: ~ln 256 per byte
    assert losses["val_loss"][12] < losses["val_loss"][0] - 1.0  # and it learned
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    counted = [r["tokens"] for r in steps if r["kind"] == "train"]

    windows, _, info = load_datasets([str(data)], ByteTokenizer(), 32, 0.1)
    completion_bytes = sum(len(r["completion"].encode()) for r in records)
    assert info.target_tokens == completion_bytes  # no eos with the byte tokenizer
    samples, expected = SampleStream(len(windows), seed=1), []
    for _ in range(12):  # 4 windows x 2 ranks a step, in the trainer's order
        _, targets = windows.batch(samples.take(8, 0, 1))
        expected.append(int((targets != IGNORE).sum()))
    assert counted == expected
    assert all(0 < n < 8 * 32 // 3 for n in counted)  # prompts are most of each window
    info_json = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info_json["corpus"]["sha256"] == info.sha256
    assert info_json["corpus"]["tokens"] == info.num_tokens
    assert info_json["corpus"]["target_tokens"] == info.target_tokens == completion_bytes
    assert (info_json["corpus"]["formats"], info_json["corpus"]["tokenizer"]) == (
        ["jsonl"],
        "bytes-v1",
    )


def test_chat_jsonl_trains_an_hf_model_on_the_assistant_replies(tiny_llama, tmp_path):
    from dataparallel.data.tokenizer import HFTokenizer

    model_dir = tiny_llama  # make_tiny_llama's defaults, built once a session (conftest.py)
    data = tmp_path / "chat.jsonl"
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"{a} plus {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
        for a in range(12)
        for b in range(12)
    ]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    args = [f"hf:{model_dir}" if arg == "gpt-tiny" else arg for arg in ARGS]
    result = train(args, tmp_path / "run", data=data)
    assert result.returncode == 0, result.stderr
    losses = curve(tmp_path / "run")
    assert losses["val_loss"][12] < losses["val_loss"][0] - 0.5
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    counted = [r["tokens"] for r in steps if r["kind"] == "train"]
    tokenizer = HFTokenizer.load(model_dir)
    windows, _, info = load_datasets([str(data)], tokenizer, 32, 0.1)  # from the run's cache
    replies = [tokenizer.encode(f"{c['messages'][1]['content']}<|endoftext|>\n") for c in chats]
    assert info.target_tokens == sum(len(r) + 1 for r in replies)  # + the eos after each chat
    samples, expected = SampleStream(len(windows), seed=1), []
    for _ in range(12):
        _, targets = windows.batch(samples.take(8, 0, 1))
        expected.append(int((targets != IGNORE).sum()))
    assert counted == expected and all(0 < n < 8 * 32 // 2 for n in counted)

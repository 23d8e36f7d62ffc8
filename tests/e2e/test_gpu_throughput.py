"""benchmarks/gpu_throughput.py at toy size on CPU (issue 40): every contender that runs on a
CPU, the optimizer section and the LoRA case, so that the GPU run has been exercised before a
device is lent. The script runs in a process of its own (forked warm): benchmarks/ stays off the
suite's sys.path."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from warm_processes import run_cli

ROOT = Path(__file__).resolve().parents[2]
THROUGHPUT = ["bound", "ours-ddp", "ours-zero3", "fsdp2", "torch-ddp", "hf-trainer", "job"]
OPTIMIZER = ["torch-forloop", "torch-foreach", "torch-fused", "ours-flat", "ours-flat-fused"]
# torchtitan's count for the toy Llama (width 64, 2 layers, vocabulary 256, SwiGLU 128, 2 of
# 4 heads for keys and values, untied head, sequence 64): 106,816 parameters, 16,384 of them
# the embedding; 6 x 90,432 + 12 x 2 x 64 x 64.
TOY_FLOPS = 6 * 90_432 + 12 * 2 * 64 * 64


def test_gpu_throughput_toy_runs_every_contender_on_cpu(tmp_path):
    table, rows_file = tmp_path / "table.md", tmp_path / "rows.json"
    command = [
        "--device",
        "cpu",
        "--size",
        "toy",
        "--compile-backend",
        "eager",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--budget",
        "150",
        "--out",
        str(table),
        "--json",
        str(rows_file),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = str(ROOT / "benchmarks" / "gpu_throughput.py")
    done = run_cli(command, env=env, timeout=170, script=script)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(rows_file.read_text())
    assert len(rows) == len(THROUGHPUT) + 2 * len(OPTIMIZER) + 1  # one LoRA row

    trained = [r for r in rows if r["section"] in ("throughput", "lora")]
    assert [r["contender"] for r in trained] == [*THROUGHPUT, "ours-ddp-lora"]
    text = table.read_text()
    for r in trained:
        assert r["ok"], r
        assert r["tokens_per_s"] > 0 and r["mfu"] is None and r["peak_bytes"] is None  # CPU
        assert r["flops_per_token"] == TOY_FLOPS
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 3
        assert text.count(f"| {r['contender']} | toy |") == 1  # one row each in the table
    assert "MFU = tokens/s x FLOPs per token / peak FLOP/s" in text

    # Same initial weights and batch: the first losses agree (bf16 autocast against bf16
    # parameters; the Trainer logs four significant digits), near ln 256 for a random model.
    api = [r for r in trained if r["contender"] != "job"]
    first = api[0]["losses"][0]
    assert abs(first - math.log(256)) < 0.05
    assert all(abs(r["losses"][0] - first) < 2e-3 for r in api), [r["losses"][0] for r in api]
    # Training on the one batch moves its loss down (the job trains on random ids: it cannot).
    assert all(r["losses"][-1] < r["losses"][0] for r in api)

    planned = {r["contender"]: r["plan_bytes"] for r in trained}
    assert all(planned[c] > 0 for c in [*THROUGHPUT, "ours-ddp-lora"])  # [Note: planner LoRA]
    assert planned["ours-ddp"] == planned["job"]  # the same plan row: ddp, bf16-params
    job = trained[THROUGHPUT.index("job")]
    assert job["note"].startswith("exit 0; dataparallel train --model hf:")
    assert "--init random" in job["note"] and "--precision bf16-params" in job["note"]

    optimizer = [r for r in rows if r["section"] == "optimizer"]
    assert [r["implementation"] for r in optimizer] == OPTIMIZER * 2
    n = len(OPTIMIZER)
    assert [r["model"] for r in optimizer] == ["toy"] * n + ["gpt-deep-narrow"] * n
    assert all(r["ms"] > 0 for r in optimizer), optimizer
    assert [r["vs_foreach"] for r in optimizer][1::n] == [1.0, 1.0]

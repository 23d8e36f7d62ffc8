"""Regenerate tests/e2e/data/reference_curve.json, the loss curve test_train_cli.py reproduces.

    .venv/bin/python tests/e2e/make_reference_curve.py

Run it only when a change is *meant* to change the numbers (a new model init, another data
order...), and say so in the commit. It trains REFERENCE_ARGS with 2 workers on the small
corpus in tests/e2e/data/corpus (a frozen copy of our own docs), so the curve does not depend
on the Python version's standard library.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
CORPUS = HERE / "data" / "corpus"
REFERENCE = HERE / "data" / "reference_curve.json"
# Small enough to run in seconds on 2 cores, large enough to exercise accumulation, clipping,
# warm-up, periodic validation over a set that does not divide by 2 (7 windows) and checkpoints.
REFERENCE_ARGS = [
    "--nproc", "2",
    "--threads", "1",
    "--model", "gpt-tiny",
    "--block-size", "32",
    "--batch", "4",
    "--accum", "2",
    "--steps", "12",
    "--lr", "3e-3",
    "--warmup-steps", "3",
    "--val-fraction", "0.1",
    "--eval-every", "6",
    "--eval-windows", "7",
    "--checkpoint-every", "6",
    "--seed", "1",
]  # fmt: skip


def train(args: list[str], out: Path, *, data: Path = CORPUS) -> subprocess.CompletedProcess:
    """Run `dataparallel train` in a subprocess (as a user would) and return the result."""
    command = [sys.executable, "-m", "dataparallel.cli", "train", "--data", str(data)]
    command += [*args, "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def curve(run_dir: Path) -> dict:
    """The train and validation losses of a run, by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {
        "train_loss": {r["step"]: r["loss"] for r in records if r["kind"] == "train"},
        "val_loss": {r["step"]: r["val_loss"] for r in records if r["kind"] == "val"},
    }


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = train(REFERENCE_ARGS, Path(tmp) / "run")
        if result.returncode != 0:
            print(result.stdout, result.stderr, file=sys.stderr)
            return 1
        losses = curve(Path(tmp) / "run")
    reference = {
        "args": REFERENCE_ARGS,
        "written_with": {"python": platform.python_version(), "torch": torch.__version__},
        "train_loss": {str(k): v for k, v in losses["train_loss"].items()},
        "val_loss": {str(k): v for k, v in losses["val_loss"].items()},
    }
    REFERENCE.write_text(json.dumps(reference, indent=2) + "\n")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

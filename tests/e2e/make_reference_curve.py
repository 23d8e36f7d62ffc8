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
import sys
import tempfile
from pathlib import Path

import torch

# Run as a script, its folder is on sys.path: the corpus, the arguments and the runner are the
# tests' own (helpers.py).
from helpers import REFERENCE, REFERENCE_ARGS, curve, train


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

"""Kill trials: `kill -9` a random worker (or the launcher) at a random moment, and check that
the run still ends with the weights of a run that was never interrupted, bit for bit.

    python benchmarks/kill_trials.py --trials 20                 # kill a worker; torchrun restarts
    python benchmarks/kill_trials.py --trials 5 --kill launcher  # then `--resume` by hand

Each trial trains gpt-tiny on 2 workers for --steps steps with a checkpoint every
--checkpoint-every steps (async saves, so kills also land while files are being written). The
first run, uninterrupted, is the reference. A worker kill must be survived by the launcher
itself (`--max-restarts`): the workers restart and resume from the latest complete checkpoint
([Note: restarts] in train/worker.py). A launcher kill takes the workers with it; the trial
then runs `dataparallel train --resume` by hand. docs/faults.md records the figures. A trial is
tests/killed_runs.py `trial`, which the tests share.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The helpers this script shares with the tests (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from killed_runs import command, environment, trial  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kill", choices=["worker", "launcher"], default="worker")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kill-trials-"))
    try:
        reference = root / "reference"
        started = time.time()
        subprocess.run(command(reference, args.steps, args.checkpoint_every), env=environment(),
                       check=True, capture_output=True)  # fmt: skip
        duration = (
            time.time() - started - 2.0
        ) * 0.85  # workers start after ~2 s; the export ends it
        print(f"reference run: {duration:.1f}s; killing a {args.kill} at a random moment in it")
        results = []
        for index in range(args.trials):
            delay = rng.uniform(0.0, duration)
            result = trial(args.kill, root / f"trial-{index}", reference / "model.safetensors",
                           delay, rng, args.steps, args.checkpoint_every)  # fmt: skip
            results.append(result)
            print(f"trial {index + 1:2d}: {json.dumps(result)}", flush=True)
            shutil.rmtree(root / f"trial-{index}", ignore_errors=True)
        good = sum(r["ok"] for r in results)
        killed = sum(r["killed"] == args.kill for r in results)
        print(f"{good} of {len(results)} identical to the uninterrupted run, bit for bit "
              f"({killed} runs had a {args.kill} killed)")  # fmt: skip
        return 0 if good == len(results) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Kill trials: `kill -9` a random worker (or the launcher) at a random moment, and check that
the run still ends with the weights of a run that was never interrupted, bit for bit.

    python benchmarks/kill_trials.py --trials 20                 # kill a worker; torchrun restarts
    python benchmarks/kill_trials.py --trials 5 --kill launcher  # then `--resume` by hand

Each trial trains gpt-tiny on 2 workers for --steps steps with a checkpoint every
--checkpoint-every steps (async saves, so kills also land while files are being written). The
first run, uninterrupted, is the reference. A worker kill must be survived by the launcher
itself (`--max-restarts`): the workers restart and resume from the latest complete checkpoint
([Note: restarts] in train/worker.py). A launcher kill takes the workers with it; the trial
then runs `dataparallel train --resume` by hand. docs/faults.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = "dataparallel.train.worker"


def command(out: Path, steps: int, every: int, extra: list[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "dataparallel.cli", "train", "--model", "gpt-tiny", "--nproc", "2",
        "--steps", str(steps), "--checkpoint-every", str(every), "--eval-every", "0",
        "--batch", "8", "--out", str(out), *extra,
    ]  # fmt: skip


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def workers_of(pid: int) -> list[int]:
    """The worker processes the launcher `pid` has started (its children running WORKER)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for child in map(int, children):
        try:
            if WORKER in Path(f"/proc/{child}/cmdline").read_text():
                out.append(child)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def same_weights(a: Path, b: Path) -> bool:
    left, right = load_file(str(a)), load_file(str(b))
    return left.keys() == right.keys() and all(left[k].equal(right[k]) for k in left)


def trial(
    kind: str,
    out: Path,
    reference: Path,
    delay: float,
    rng: random.Random,
    steps: int,
    every: int,
    timeout: float = 300,
) -> dict:
    """One run killed after `delay` seconds; what happened and whether the weights match."""
    launcher = subprocess.Popen(
        command(out, steps, every), env=environment(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 60
    while not workers_of(launcher.pid) and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # the delay counts from the workers' start
    time.sleep(delay)
    victim, killed_workers = None, []
    if kind == "worker":
        workers = workers_of(launcher.pid)
        if workers and launcher.poll() is None:
            victim = rng.choice(workers)
            os.kill(victim, signal.SIGKILL)
    elif launcher.poll() is None:
        killed_workers = workers_of(launcher.pid)
        victim = launcher.pid
        os.kill(launcher.pid, signal.SIGKILL)
    try:
        _, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        return {"ok": False, "killed": kind, "delay_s": round(delay, 2), "why": "timed out"}
    code, resumed = launcher.returncode, False
    if kind == "launcher" and victim is not None:
        deadline = time.time() + 30
        while any(alive(w) for w in killed_workers) and time.time() < deadline:
            time.sleep(0.1)
        orphans = [w for w in killed_workers if alive(w)]
        if orphans:
            for orphan in orphans:
                os.kill(orphan, signal.SIGKILL)
            why = f"workers {orphans} outlived the launcher"
            return {"ok": False, "killed": kind, "delay_s": round(delay, 2), "why": why}
        if (out / "checkpoint" / "latest").exists():
            again = subprocess.run(
                [sys.executable, "-m", "dataparallel.cli", "train", "--resume", str(out)],
                env=environment(), capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
            code, stderr, resumed = again.returncode, again.stderr, True
        else:  # killed before the first checkpoint: start the run again
            shutil.rmtree(out, ignore_errors=True)
            again = subprocess.run(
                command(out, steps, every),
                env=environment(),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            code, stderr = again.returncode, again.stderr
    weights = out / "model.safetensors"
    info = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    same = code == 0 and weights.exists() and same_weights(weights, reference)
    return {
        "ok": same,
        "killed": kind if victim is not None else "nothing (run over)",
        "delay_s": round(delay, 2),
        "resumes": len(info.get("resumed_at", [])),
        "resumed_by_hand": resumed,
        "why": "" if same else f"exit {code}: {stderr.strip().splitlines()[-1:] if stderr else ''}",
    }


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

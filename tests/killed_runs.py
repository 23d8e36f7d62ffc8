"""A run killed (`kill -9` of a worker or of the launcher) at a given moment, and whether it
still ends with the weights of a run never interrupted, bit for bit: one trial, for
tests/e2e/test_faults.py and for benchmarks/kill_trials.py, which runs many (its docstring says
how a trial goes; docs/faults.md records the figures).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file
from worker_pids import children, rank_of

ROOT = Path(__file__).resolve().parents[1]  # the repository


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
    """The worker processes the launcher `pid` has started: its children that have a rank (a
    forked worker is named "dp rank N", and its command line is the launcher's; a fresh one has
    RANK in its environment: worker_pids.rank_of)."""
    return [child for child in children(pid, deep=False) if rank_of(child) is not None]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def last_step(out: Path) -> int:
    """The last training step in the run's metrics.jsonl (0 if none yet)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if '"kind": "train"' in line]
    return max(steps, default=0)


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
    when=None,
) -> dict:
    """One run killed after `delay` seconds; what happened and whether the weights match.
    The delay counts from the workers' start, and, when `when` is given, from `when(out)`
    holding too (a step recorded, say: a forked worker trains within a second of its start,
    so a test's short run can be over before a delay counted from the start alone)."""
    launcher = subprocess.Popen(
        command(out, steps, every), env=environment(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 60
    while not workers_of(launcher.pid) and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # the delay counts from the workers' start
    while when is not None and not when(out) and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.02)
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

"""A run signalled (SIGTERM or SIGUSR1, to the launcher or to it and its workers) once a
condition holds, what it did, and a preemption trial: the run stopped, then resumed with
`--resume auto` to the end, against a run never interrupted. For tests/e2e/test_preemption.py
and for benchmarks/preempt_trials.py, which runs many (its docstring says how a trial goes).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from killed_runs import environment, last_step, same_weights, workers_of

PREEMPTED = 75


def command(out: Path, steps: int, every: int, extra: list[str] = ()) -> list[str]:
    """The one command every session of a trial runs (the first starts it, the next resume)."""
    return [
        sys.executable,
        "-m",
        "dataparallel.cli",
        "train",
        "--model",
        "gpt-tiny",
        "--nproc",
        "2",
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(every),
        "--eval-every",
        "0",
        "--batch",
        "8",
        "--out",
        str(out),
        "--resume",
        "auto",
        *extra,
    ]


def latest_step(out: Path) -> int | None:
    try:
        name = (out / "checkpoint" / "latest").read_text().strip()
    except OSError:
        return None
    return int(name.removeprefix("step-"))


def signal_run(
    args: list[str],
    out: Path,
    when,
    sig: signal.Signals,
    *,
    everyone: bool = False,
    again_after_s: float | None = None,
    env: dict | None = None,
    timeout: float = 300,
) -> dict:
    """Run `args`, send `sig` once `when(out)` holds (the launcher; with `everyone` its workers
    too; with `again_after_s` the launcher a second time), and report what happened."""
    launcher = subprocess.Popen(
        args,
        env={**environment(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + timeout
    while not when(out) and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    at_step, signalled = last_step(out), time.perf_counter()
    targets = [launcher.pid] + (workers_of(launcher.pid) if everyone else [])
    if launcher.poll() is None:
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    if again_after_s is not None:
        time.sleep(again_after_s)
        if launcher.poll() is None:
            os.kill(launcher.pid, sig)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        stdout, stderr = launcher.communicate()
    stopped = re.search(r"after step (\d+); checkpoint step-\d+ written in ([\d.]+) s", stdout)
    return {
        "code": launcher.returncode,
        "signalled_at_step": at_step,
        "stopped_after": int(stopped.group(1)) if stopped else None,
        "save_s": float(stopped.group(2)) if stopped else None,
        "exit_s": round(time.perf_counter() - signalled, 2),
        "latest": latest_step(out),
        "stdout": stdout,
        "stderr": stderr,
    }


def trial(out: Path, reference: Path, steps: int, every: int, k: int, rng: random.Random) -> dict:
    """Trial `k`: SIGTERM on even k, SIGUSR1 on odd; the workers signalled too every other
    pair; then `--resume auto`."""
    sig = signal.SIGTERM if k % 2 == 0 else signal.SIGUSR1
    everyone = (k // 2) % 2 == 1
    at = rng.randint(1, steps - 1)
    args = command(out, steps, every)
    first = signal_run(args, out, lambda o: last_step(o) >= at, sig, everyone=everyone)
    result = {
        "signal": sig.name,
        "to": "launcher and workers" if everyone else "launcher",
        **{key: first[key] for key in ("signalled_at_step", "stopped_after", "save_s", "exit_s")},
        "code": first["code"],
        "latest": first["latest"],
    }
    stopped = first["stopped_after"]
    ok = first["code"] == PREEMPTED and stopped is not None and first["latest"] == stopped
    resumed = subprocess.run(args, env=environment(), capture_output=True, text=True)
    result["resume_code"] = resumed.returncode
    result["bitwise"] = resumed.returncode == 0 and same_weights(
        out / "model.safetensors", reference
    )
    result["ok"] = bool(ok and result["bitwise"])
    if not result["ok"]:
        result["stderr"] = (first["stderr"] + resumed.stderr)[-2000:]
    return result

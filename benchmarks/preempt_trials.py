"""Preemption trials: SIGTERM or SIGUSR1 at a random step, then the same command with
`--resume auto`; every trial must end with the weights of a run never interrupted, bit for bit.

    python benchmarks/preempt_trials.py --trials 10          # SIGTERM and SIGUSR1 in turn
    python benchmarks/preempt_trials.py --agreement          # the per-step flag's cost

Each trial trains gpt-tiny on 2 workers (--steps steps, a checkpoint every --checkpoint-every
steps, async saves) and signals once step S (random, 1..steps-1) is in metrics.jsonl: the
launcher alone, or, every other trial, the launcher and both workers at once (as Slurm signals
every task). It checks the exit status (75), that the latest checkpoint is the step rank 0 says
it stopped after, and then runs the same command with `--resume auto` to the end. The first
run, uninterrupted (also through `--resume auto`, which starts it), is the reference.
docs/faults.md and BENCHMARKS.md record the figures ([Note: preemption] in
src/dataparallel/launch/preemption.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kill_trials import environment, same_weights, workers_of  # noqa: E402

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


def last_step(out: Path) -> int:
    """The last training step in the run's metrics.jsonl (0 if none yet)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if '"kind": "train"' in line]
    return max(steps, default=0)


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


def agreement_cost(rounds: int = 2000) -> dict:
    """Seconds per agreement (a 1-int MAX all-reduce over 2 gloo ranks), and per gpt-tiny step
    of the trials' command, measured on this machine."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_agree_worker, args=(rounds, tmp), nprocs=2)
        return json.loads((Path(tmp) / "agree.json").read_text())


def _agree_worker(rank: int, rounds: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    flag = torch.zeros(1, dtype=torch.int32)
    for _ in range(50):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(rounds):
        flag.fill_(0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        int(flag.item())
    seconds = (time.perf_counter() - started) / rounds
    if rank == 0:
        (Path(tmp) / "agree.json").write_text(json.dumps({"agree_s": seconds, "rounds": rounds}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--checkpoint-every", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agreement", action="store_true", help="measure the flag's cost")
    args = parser.parse_args()
    if args.agreement:
        print(json.dumps(agreement_cost()))
        return 0
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="preempt_trials_"))
    try:
        reference = work / "reference"
        started = time.perf_counter()
        done = subprocess.run(
            command(reference, args.steps, args.checkpoint_every),
            env=environment(),
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        step_s = (time.perf_counter() - started) / args.steps
        results = []
        for k in range(args.trials):
            result = trial(
                work / f"trial{k}",
                reference / "model.safetensors",
                args.steps,
                args.checkpoint_every,
                k,
                rng,
            )
            results.append(result)
            print(json.dumps(result), flush=True)
        passed = sum(r["ok"] for r in results)
        saves = [r["save_s"] for r in results if r["save_s"] is not None]
        exits = [r["exit_s"] for r in results]
        print(
            json.dumps(
                {
                    "passed": passed,
                    "trials": len(results),
                    "reference_s_per_step_with_start": round(step_s, 2),
                    "save_s_max": max(saves, default=None),
                    "exit_s_max": max(exits),
                    "exit_s_median": sorted(exits)[len(exits) // 2],
                }
            )
        )
        return 0 if passed == len(results) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

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
src/dataparallel/launch/preemption.py). A trial is tests/signalled_runs.py `trial`, which the
tests share.
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
from killed_runs import environment  # noqa: E402
from signalled_runs import command, trial  # noqa: E402


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

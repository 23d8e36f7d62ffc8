"""Live recovery trials: kill (or stop) a worker of a `--recovery live` run and measure.

    python benchmarks/live_trials.py                          # SIGKILL worker 1 at step 10
    python benchmarks/live_trials.py --signal STOP --collective-timeout 8 --worker 2
    python benchmarks/live_trials.py --signal HANG --collective-timeout 8 --worker 2  # needs gdb
    python benchmarks/live_trials.py --steps 250 --at 10 120 180 --worker 1 2 1   # three kills
    python benchmarks/live_trials.py --pairs 2     # no failure: live mode's cost per step
    python benchmarks/live_trials.py --sync "--diloco 20" --at 40   # under an averager
    python benchmarks/live_trials.py --sync "--nproc 4 --shard-group 2 --strategy zero2 --batch 3"

Runs gpt-tiny on 3 workers twice with the same flags: uninterrupted, then live with the signal
sent to worker --worker once the metrics show step --at (several: one after the other; the
workers never signalled are the survivors). Prints whether the survivors kept their
process ids, when the replacement joined, whether every step is in the metrics once, the
max |difference| of the final weights, the longest step of the live run (from one step's
end to the next's: the survivors' pause and the redone step) against the median step, and the step efficiency: the uninterrupted run's training
time over the live run's (metrics.jsonl's elapsed_s at the last step). docs/faults.md, "Live
recovery", has the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The helpers this script shares with the tests (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from safetensors.torch import load_file  # noqa: E402
from worker_pids import live_workers  # noqa: E402

from dataparallel.train.metrics import read_metrics  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "data" / "corpus"
GENERATION = re.compile(r"generation (\d+): workers \[([\d, ]+)\] \(pids ([\d, ]+)\) at step (\d+)")


def flags(
    steps: int, extra: str = "", nproc: int = 3, ranks: int = 0, checkpoint_every: int = 0
) -> list[str]:
    """The trials' run: gpt-tiny, a global batch of 12 windows over `ranks` (0: `nproc`);
    `extra` flags come last and win (e.g. "--nproc 4 --shard-group 2")."""
    ranks = ranks or nproc
    if 12 % ranks:
        raise ValueError(f"{ranks} ranks do not divide the global batch of 12")
    return [
        "--data", str(CORPUS), "--nproc", str(nproc), "--threads", "1", "--model", "gpt-tiny",
        "--block-size", "32", "--batch", str(12 // ranks), "--accum", "1", "--steps", str(steps),
        "--lr", "3e-4", "--warmup-steps", "3", "--val-fraction", "0.1", "--eval-every", "50",
        "--eval-windows", "7", "--checkpoint-every", str(checkpoint_every), "--log-every", "50",
        "--seed", "1", *extra.split(),
    ]  # fmt: skip


def records(run: Path) -> list[dict]:
    """The train records of the run's metrics.jsonl so far (a line being written is not read)."""
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def trial(args, folder: Path) -> dict:
    command = [sys.executable, "-m", "dataparallel.cli", "train", *flags(args.steps, args.sync)]
    reference = folder / "reference"
    subprocess.run([*command, "--out", str(reference)], check=True, capture_output=True)
    out = folder / "live"
    live = [*command, "--recovery", "live", "--collective-timeout", str(args.collective_timeout)]
    launcher = subprocess.Popen(
        [*live, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if len(args.worker) != len(args.at):
        raise SystemExit("give one --worker per --at")
    first = None
    for at, slot in zip(args.at, args.worker, strict=True):
        while not any(r["step"] >= at for r in records(out)):
            if launcher.poll() is not None:
                raise SystemExit(f"the live run ended before step {at}")
            time.sleep(0.02)
        now = live_workers(launcher.pid)
        first = first or now
        if args.signal == "HANG":  # running, not stopped: sleeping inside a call gdb makes
            subprocess.Popen(["gdb", "-p", str(now[slot]), "-batch", "-ex",
                              "call (unsigned int)sleep(100000)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        else:
            os.kill(now[slot], getattr(signal, f"SIG{args.signal}"))
    _, stderr = launcher.communicate(timeout=600)
    generations = [m.groups() for m in GENERATION.finditer(stderr)]
    survivors = {s: p for s, p in first.items() if s not in args.worker}
    kept = all(
        str(p) in pids.split(", ") for _, _, pids, _ in generations for p in survivors.values()
    )
    ours, theirs = (
        load_file(str(out / "model.safetensors")),
        load_file(str(reference / "model.safetensors")),
    )
    elapsed_at = [r["elapsed_s"] for r in records(out)]
    gaps = [b - a for a, b in zip(elapsed_at[:-1], elapsed_at[1:], strict=True)]  # and pauses
    elapsed = {
        name: records(run)[-1]["elapsed_s"] for name, run in (("ref", reference), ("live", out))
    }
    return {
        "status": launcher.returncode,
        "survivors kept their pids": kept,
        "generations": [(int(g), m, int(s)) for g, m, _, s in generations],
        "every step once": [r["step"] for r in records(out)] == list(range(1, args.steps + 1)),
        "max |difference|": max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
        "longest step s": round(max(gaps), 3),
        "median step s": round(statistics.median(gaps), 3),
        "efficiency": round(elapsed["ref"] / elapsed["live"], 3),
    }


def overhead(args, folder: Path) -> dict:
    """Median step time of `--pairs` interleaved runs without failures: restart, then live."""
    command = [sys.executable, "-m", "dataparallel.cli", "train", *flags(args.steps, args.sync)]
    medians: dict[str, list[float]] = {"restart": [], "live": []}
    means: dict[str, list[float]] = {"restart": [], "live": []}  # with an averager's boundaries
    for pair in range(args.pairs):
        for mode in medians:
            out = folder / f"{mode}-{pair}"
            subprocess.run([*command, "--recovery", mode, "--out", str(out)], check=True,
                           capture_output=True)  # fmt: skip
            medians[mode].append(statistics.median(r["step_time_s"] for r in records(out)[5:]))
            means[mode].append(statistics.mean(r["step_time_s"] for r in records(out)[5:]))
    restart, live = (statistics.median(medians[m]) for m in ("restart", "live"))
    mean = {m: statistics.median(means[m]) for m in means}
    return {
        "mean step s, restart / live": (round(mean["restart"], 4), round(mean["live"], 4)),
        "mean live / restart": round(mean["live"] / mean["restart"], 3),
        "median step s, restart": round(restart, 4),
        "median step s, live": round(live, 4),
        "live / restart": round(live / restart, 3),
        "per pair": [
            round(b / a, 3) for a, b in zip(medians["restart"], medians["live"], strict=True)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--at", type=int, nargs="+", default=[10], help="signal a worker "
                        "after each of these steps")  # fmt: skip
    parser.add_argument("--worker", type=int, nargs="+", default=[1],
                        help="their slots (0, 1 or 2)")  # fmt: skip
    parser.add_argument("--signal", default="KILL", choices=["KILL", "STOP", "HANG"],
                        help="HANG: the worker sleeps inside a call made by gdb (state S, "
                        "not T: the launcher cannot tell it is stopped)")  # fmt: skip
    parser.add_argument("--collective-timeout", type=float, default=20.0)
    parser.add_argument(
        "--sync", default="", help='flags added to both runs (they win), e.g. "--diloco 20"'
    )
    parser.add_argument("--pairs", type=int, default=0, help="no failure: this many interleaved "
                        "restart/live runs, and the cost of live mode per step")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        measure = overhead if args.pairs else trial
        for key, value in measure(args, Path(folder)).items():
            print(f"{key:28} {value}")


if __name__ == "__main__":
    main()

"""How long a checkpoint stops training: sync against async saves, on gpt-medium.

    python benchmarks/bench_checkpoint.py --repeats 2

Runs `dataparallel train` with a checkpoint every --every steps, under
`--checkpoint-save sync`, `async`, and with no checkpoint but the final one ("none"),
interleaved, --repeats times each. From metrics.jsonl: the stall of a checkpoint is the wall
time between the end of a checkpointed step and the end of the next one, minus that next
step's own time (what the training thread spent in the save), and the run's training time
against "none" says what the saves cost in all, the background writes' competition for the
cores included. Reports medians and ratios; BENCHMARKS.md keeps the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, out: Path, args) -> dict:
    every = args.every if mode != "none" else 0
    command = [
        sys.executable, "-m", "dataparallel.cli", "train", "--model", args.model,
        "--nproc", str(args.nproc), "--steps", str(args.steps), "--batch", str(args.batch),
        "--block-size", str(args.block_size), "--eval-every", "0", "--out", str(out),
        "--checkpoint-every", str(every), "--checkpoint-save", "sync" if mode == "none" else mode,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(command, check=True, capture_output=True, env=env)
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = {r["step"]: r for r in records if r["kind"] == "train"}
    stalls = []
    for step in range(every, args.steps, every) if every else []:
        if step + 1 in steps:
            gap = steps[step + 1]["elapsed_s"] - steps[step]["elapsed_s"]
            stalls.append(gap - steps[step + 1]["step_time_s"])
    size = sum(p.stat().st_size for p in (out / "checkpoint").glob("step-*/*"))
    last = max(steps)
    return {"stalls": stalls, "train_s": steps[last]["elapsed_s"], "bytes": size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-medium")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"sync": [], "async": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in results:  # interleaved: sync, async, none, sync, ...
                result = run(mode, Path(tmp) / f"{mode}-{repeat}", args)
                results[mode].append(result)
                stalls = ", ".join(f"{s:.3f}" for s in result["stalls"])
                print(
                    f"{mode:5s} #{repeat}: stalls [{stalls}] s, training {result['train_s']:.1f} s"
                )
    none = statistics.median(r["train_s"] for r in results["none"])
    size = results["sync"][0]["bytes"] / 2 / 1e6  # two checkpoints are kept
    print(f"\n{args.model}, {args.nproc} ranks, a checkpoint of {size:.0f} MB every {args.every} "
          f"steps ({args.steps} steps)")  # fmt: skip
    print("| save | stall per checkpoint (median) | training time | vs no checkpoints |")
    print("|---|--:|--:|--:|")
    for mode in ("sync", "async"):
        stall = statistics.median(s for r in results[mode] for s in r["stalls"])
        train = statistics.median(r["train_s"] for r in results[mode])
        print(f"| {mode} | {stall * 1000:.0f} ms | {train:.1f} s | {train / none:.3f}x |")
    print(f"| none | — | {none:.1f} s | 1.000x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

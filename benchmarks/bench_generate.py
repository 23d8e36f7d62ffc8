"""What `dataparallel generate` gains from 2 workers: the same prompts with 1 and 2 workers.

    python benchmarks/bench_generate.py --repeats 3

Builds a small Llama (random weights, the byte-level BPE tokenizer of tests/hf_fixtures.py,
nothing downloaded) and a prompts file of lines of standard-library source, then runs
`dataparallel generate` with 1 worker (the default threads: every core; and 1 thread) and 2
workers (1 thread each on 2 cores), interleaved, --repeats times each
(greedy, so every run writes the same completions, which is checked). Reports the medians of
the generation time rank 0 reports (after the model is loaded, to the file written), of the
model's loading, and of the command's wall time (start-up included: interpreter, torch,
transformers, the launcher), and the ratios to 1 worker.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def prompts_file(path: Path, count: int) -> Path:
    """`count` non-empty lines of textwrap.py, each a prompt."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) > 12]
    path.write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines[:count]))
    return path


# (workers, torch threads per worker; 0: the launcher's fair share, max(1, cores // workers))
SETUPS = [(1, 0), (1, 1), (2, 0)]


def run(model: Path, prompts: Path, out: Path, setup, args) -> tuple[float, float, float]:
    nproc, threads = setup
    command = [
        sys.executable, "-m", "dataparallel.cli", "generate", str(model),
        "--prompts", str(prompts), "--out", str(out), "--tokens", str(args.tokens),
        "--batch", str(args.batch), "--nproc", str(nproc), "--threads", str(threads),
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    found = re.search(r"load ([0-9.]+) s, generate ([0-9.]+) s\)", result.stdout)
    return wall, float(found.group(1)), float(found.group(2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from hf_fixtures import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_tiny_llama(tmp / "llama", layers=args.layers, width=args.width)
        prompts = prompts_file(tmp / "prompts.jsonl", args.prompts)
        times: dict[tuple, list[tuple[float, float, float]]] = {s: [] for s in SETUPS}
        outputs: dict[tuple, str] = {}
        for _ in range(args.repeats):
            for setup in SETUPS:
                out = tmp / "out.jsonl"
                times[setup].append(run(model, prompts, out, setup, args))
                outputs[setup] = out.read_text()
        if len(set(outputs.values())) != 1:
            raise SystemExit("the completions of 1 and 2 workers differ")
    print(
        f"{args.prompts} prompts x {args.tokens} new tokens, batch {args.batch}, Llama "
        f"{args.layers} layers x {args.width}, {args.repeats} runs each, medians"
    )
    print("| workers x threads | generate | model load | command wall (start-up included) |")
    print("|--|--:|--:|--:|")
    medians = {s: [statistics.median(t[i] for t in times[s]) for i in (0, 1, 2)] for s in SETUPS}
    base = medians[SETUPS[0]]
    for setup in SETUPS:
        wall, load, work = medians[setup]
        threads = setup[1] or f"{max(1, (os.cpu_count() or 1) // setup[0])} (default)"
        print(
            f"| {setup[0]} x {threads} | {work:.2f} s ({base[2] / work:.2f}x) | {load:.2f} s "
            f"| {wall:.2f} s ({base[0] / wall:.2f}x) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

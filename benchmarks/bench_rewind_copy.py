"""What a live run's rewind copy costs per step under --compress (docs/faults.md, "Live recovery").

    python benchmarks/bench_rewind_copy.py                 # gpt-tiny
    python benchmarks/bench_rewind_copy.py --model gpt-small

Builds a model's gradient bucket (its parameters, as one DDP bucket), reduces it a few times
on one rank through each compressor to fill its state, then times `StepCopy.take` (the copy a
live run takes at every step's start: compression/live.py) against one compressed reduction,
on one thread. Prints the bytes copied and the medians over 30 steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from dataparallel.comm.hooks import HookState
from dataparallel.compression import build_hook
from dataparallel.compression.live import StepCopy
from dataparallel.models import build_model

SPECS = ["powersgd:rank=2", "topk:ratio=0.01", "int8"]


def measure(spec: str, shapes: list, numel: int, steps: int) -> tuple[int, float, float]:
    """(bytes copied, median take s, median compressed reduction s)."""
    hook, state = build_hook(spec), HookState(SimpleNamespace(world_size=1, rank=0))
    gradient = torch.randn(numel)

    def reduce() -> float:
        bucket = SimpleNamespace(index=0, buffer=gradient.clone(), shard=None, shapes=shapes)
        began = time.perf_counter()
        hook(state, bucket).wait()
        return time.perf_counter() - began

    for _ in range(3):
        reduce()
    copy, takes, reductions = StepCopy(hook), [], []
    for _ in range(steps):
        began = time.perf_counter()
        copy.take()
        takes.append(time.perf_counter() - began)
        reductions.append(reduce())
    copied = sum(t.numel() * t.element_size() for t in copy.copies.values())
    return copied, statistics.median(takes), statistics.median(reductions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.model, block_size=32)
    params = list(reversed([p for p in model.parameters() if p.requires_grad]))
    shapes, numel = [], 0
    for p in params:
        shapes.append((numel, p.shape))
        numel += p.numel()
    print(f"{args.model}: {numel} parameters")
    for spec in SPECS:
        copied, take, reduction = measure(spec, shapes, numel, args.steps)
        print(
            f"{spec}: copy {copied / 1e6:.2f} MB, take {take * 1e3:.3f} ms, compressed "
            f"reduction {reduction * 1e3:.2f} ms ({take / reduction:.1%})"
        )


if __name__ == "__main__":
    main()

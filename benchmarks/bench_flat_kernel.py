"""torch's three kernels for one optimizer update over one flat tensor ([Note: the fused flat
step] in src/dataparallel/strategies/parts/flat_step.py): the for-loop, `foreach` and
`fused`, as the flat step would run them over a run of parameters.

    python benchmarks/bench_flat_kernel.py --sizes 1.2e6,2e7 --rounds 15

One fp32 parameter of each size with a fixed gradient, one optimizer per kernel, stepped in
interleaved rounds (each round steps every kernel once, in a rotating order; 3 untimed rounds
first); medians in ms and the ratio to the for-loop, then how far apart the fused kernel's
parameter is from the for-loop's after all those steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

KERNELS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
CLASSES = {c.__name__: c for c in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)}


def measure(cls, numel: int, rounds: int, warmup: int = 3) -> tuple[dict, dict]:
    """Median ms per kernel, and each kernel's parameter after every step it took."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator)
    extra = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    params, optimizers, times = {}, {}, {name: [] for name in KERNELS}
    for name, options in KERNELS.items():
        params[name] = torch.nn.Parameter(start.clone())
        params[name].grad = grad.clone()
        optimizers[name] = cls([params[name]], lr=1e-3, **extra, **options)
    names = list(KERNELS)
    for step in range(warmup + rounds):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            started = time.perf_counter()
            optimizers[name].step()
            if step >= warmup:
                times[name].append(time.perf_counter() - started)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1.2e6,2e7", help="elements of the flat tensor")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds")
    p.add_argument("--optimizers", default="AdamW", help=f"of {', '.join(CLASSES)}")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds")
    print(
        "| optimizer | elements | "
        + " | ".join(f"{k} ms" for k in KERNELS)
        + " | fused vs for-loop | max diff |"
    )
    print("|---|--:|" + "--:|" * len(KERNELS) + "--:|--:|")
    for cls_name in args.optimizers.split(","):
        for numel in (int(float(s)) for s in args.sizes.split(",")):
            ms, params = measure(CLASSES[cls_name], numel, args.rounds)
            diff = (params["fused"] - params["for-loop"]).abs().max().item()
            cells = " | ".join(f"{ms[k]:.2f}" for k in KERNELS)
            ratio = ms["fused"] / ms["for-loop"]
            print(f"| {cls_name} | {numel:,} | {cells} | {ratio:.3f} | {diff:.2e} |")


if __name__ == "__main__":
    main()

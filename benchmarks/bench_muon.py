"""Muon + AdamW step time: DDP (every rank runs Newton-Schulz on every matrix) against ZeRO-1/2/3
with distributed Muon (each matrix orthogonalised once, on its owner), and the optimizer step's
share of the step for each.

    python benchmarks/bench_muon.py --model gpt-small --nproc 2 --rounds 7 --steps 10 --warmup 3

Two passes over the same contenders, muon-ddp, muon-zero1, muon-zero2 and muon-zero3 (each the
job's recipe, train/optimizers.py: torch.optim.Muon on the blocks' matrices with
adjust_lr_fn="match_rms_adamw", AdamW on the embeddings, norms and biases, one
dp.build_optimizer call):
1. bench_step.py's interleaved rounds: the step's wall time, medians over rounds, ratios
   paired round by round (`--rounds`, `--interleave` as there);
2. bench_phases.py: each phase's CPU on the training thread (zero_grad, forward, backward,
   step), medians over `--steps` alternating steps; the step phase over the whole is the
   optimizer step's share (under ZeRO it includes the owners' sends of the new values and
   ZeRO-1/2's all-gather after the update; the gradients' sends to the owners end backward).
AdamW (flat shards) unchanged by the optimizer layout, against 729a36c (before it landed):

    python benchmarks/bench_step.py --model gpt-small --nproc 2 --baseline 729a36c \
        --contenders ddp,old-ddp,zero1,old-zero1,zero2,old-zero2,zero3,old-zero3
"""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp
from contenders import CONTENDERS, LR, Prepared, plain_step

import dataparallel as dp
from dataparallel.train.config import OptimConfig
from dataparallel.train.optimizers import choose_optimizer

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def muon(strategy: str):
    """The contender muon-<strategy>: the job's Muon + AdamW recipe at lr 3e-4."""

    def setup(model, world) -> Prepared:
        dp.parallelize(model, dp.strategies.POLICIES[strategy](), group=world.group)
        choice = choose_optimizer(OptimConfig(optimizer="muon"), model, LR)
        optimizer = dp.build_optimizer(model, choice.cls, params=choice.groups, **choice.kwargs)
        return Prepared(
            plain_step(model, optimizer),
            lambda: dp.memory_report(model, optimizer),
            lambda: dp.finish_param_gather(model),
        )

    return setup


# At import, so that the spawned ranks (which import this module as __mp_main__) know them too.
CONTENDERS.update({f"muon-{s}": muon(s) for s in STRATEGIES})
NAMES = ",".join(f"muon-{s}" for s in STRATEGIES)


def _without(argv: list[str], flag: str) -> list[str]:
    """`argv` less `flag` and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    import bench_phases
    import bench_step

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--contenders" not in argv:
        argv += ["--contenders", NAMES]
    print("## step time (bench_step.py, interleaved rounds)\n", flush=True)
    bench_step.main(argv)
    print("\n## phases (bench_phases.py): the optimizer step's share\n", flush=True)
    args = bench_phases.parse_args(
        _without(_without(_without(argv, "--rounds"), "--interleave"), "--json")
    )
    args.warmup = max(args.warmup, 1)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(bench_phases.run_rank, args=(args, bench_step.free_port(), queue), nprocs=args.nproc)
    per_rank = queue.get()
    print(bench_phases.render(per_rank, args), end="\n\n")
    print(shares(per_rank))


def shares(per_rank: list[dict]) -> str:
    """The optimizer step's share of each contender's step (thread CPU), on its slowest rank."""
    lines = []
    for name in per_rank[0]:
        rows = [medians[name] for medians in per_rank]
        step, whole = max(r["step"] for r in rows), max(r["thread"] for r in rows)
        lines.append(
            f"- {name}: optimizer step {step:.1f} ms of {whole:.1f} ms thread CPU "
            f"({step / whole:.0%})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

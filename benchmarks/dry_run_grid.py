"""The dry run against the plan on the full grid ([Note: dry run of a plan] in
src/dataparallel/plan/dry_run.py): built-in GPTs and llama-8b, DDP, ZeRO-1/2/3, a 2-D mesh
(ZeRO-2 on shard groups of 8) and a dp x tp mesh (ZeRO-3, tp 2), worlds of 2 to 4,096 ranks,
bf16 parameters with fp32 masters and AdamW. Per case: the roles run, rank 0's held bytes by
the engine and by the plan, the step's collective bytes by the engine and by the plan, whether
every role agrees (held bytes, ZeRO-3's largest gathered unit, collective bytes), rank 0's peak
of meta storages alive at once in the step beside the plan's peak (not compared), and the wall time of the whole case (plan, and per role: the fake world,
parallelize, build_optimizer, two steps).

    PYTHONPATH=src python benchmarks/dry_run_grid.py [--models gpt-small,llama-8b] [--seq-len 256]

Exit status 1 if any case differs. The table is in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from dataparallel.plan.dry_run import dry_run

WORLDS = (2, 8, 64, 1024, 4096)
LAYOUTS = {
    "ddp": ("ddp", None, 1),
    "zero1": ("zero1", None, 1),
    "zero2": ("zero2", None, 1),
    "zero3": ("zero3", None, 1),
    "zero2 S=8 (2-D)": ("zero2", 8, 1),
    "zero3 tp=2": ("zero3", None, 2),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,gpt-medium,llama-8b")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    args = parser.parse_args()
    worlds = [int(n) for n in args.worlds.split(",")]
    print(
        "| model | layout | ranks | roles | held GB engine / plan (rank 0) | collectives "
        "MB engine / plan | agrees | peak GB meta / plan | s |"
    )
    print("|---|---|---:|---|---|---|---|---|---:|")
    failed = 0
    for model in args.models.split(","):
        for name, (strategy, shard, tp) in LAYOUTS.items():
            for n in worlds:
                if n // tp < 2 or (shard and shard >= n // tp):
                    continue
                start = time.perf_counter()
                result = dry_run(model, ranks=n, strategy=strategy, shard_size=shard, tp=tp,
                                 precision="bf16-params", seq_len=args.seq_len)  # fmt: skip
                seconds = time.perf_counter() - start
                first = result.runs[0]
                engine = sum(first.held[k] for k in ("params", "grads", "optimizer_state"))
                planned = sum(first.planned[k] for k in ("params", "grads", "optimizer_state"))
                sent = sum(b for b, _ in first.collectives.values())
                plan_sent = sum(b for b, _ in first.planned_collectives.values())
                ok = not result.differences()
                failed += not ok
                roles = " ".join(str(run.role.shard_rank) for run in result.runs)
                print(f"| {model} | {name} | {n} | {roles} | {engine / 1e9:.6f} / "
                      f"{planned / 1e9:.6f} | {sent / 1e6:.3f} / {plan_sent / 1e6:.3f} | "
                      f"{'yes' if ok else 'NO'} | {first.peak / 1e9:.4f} / "
                      f"{result.row.peak_bytes / 1e9:.4f} | {seconds:.1f} |", flush=True)  # fmt: skip
                for line in result.differences():
                    print(f"  DIFFERS: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

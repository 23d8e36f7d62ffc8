"""The dry run against the plan on the full grid ([Note: dry run of a plan] in
src/dataparallel/plan/dry_run.py): built-in GPTs and llama-8b, DDP, ZeRO-1/2/3, a 2-D mesh
(ZeRO-2 on shard groups of 8) and a dp x tp mesh (ZeRO-3, tp 2), worlds of 2 to 4,096 ranks,
bf16 parameters with fp32 masters and AdamW. Per case: the roles run, rank 0's held bytes by
the engine and by the plan, the step's collective bytes by the engine and by the plan, whether
every role agrees (held bytes, ZeRO-3's largest gathered unit, collective bytes), rank 0's peak
of meta storages alive at once in the step beside the plan's peak, whether every role's peak is
within 1% of it (DDP and ZeRO-1: PEAK_COMPARED in plan/dry_run.py; "not compared" elsewhere),
and the wall time of the whole case (plan, and per role: the fake world, parallelize,
build_optimizer, two steps).

    PYTHONPATH=src python benchmarks/dry_run_grid.py [--models gpt-small,llama-8b] [--seq-len 256]
    PYTHONPATH=src python benchmarks/dry_run_grid.py --terms   # the peak, term by term

With --terms, only the cases of TERM_CASES, rank 0, and per case the peak's terms
([Note: peak terms] in src/dataparallel/plan/peak_terms.py): MB alive at the dry run's peak,
MB in the plan's model, and the gap; the table is in docs/plan.md.

Exit status 1 if any case's held bytes or collectives differ (a peak beyond 1% is marked NO,
with its DIFFERS line on stderr, and does not set the status). The table is in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from dataparallel.plan.dry_run import PEAK_COMPARED, dry_run
from dataparallel.plan.peak_terms import peak_terms

WORLDS = (2, 8, 64, 1024, 4096)
LAYOUTS = {
    "ddp": ("ddp", None, 1),
    "zero1": ("zero1", None, 1),
    "zero2": ("zero2", None, 1),
    "zero3": ("zero3", None, 1),
    "zero2 S=8 (2-D)": ("zero2", 8, 1),
    "zero3 tp=2": ("zero3", None, 2),
}
# (model, strategy, ranks, tokens): the cases docs/plan.md breaks down
TERM_CASES = (
    ("gpt-small", "ddp", 2, 256), ("gpt-small", "ddp", 64, 256),
    ("gpt-small", "zero1", 2, 256), ("gpt-small", "zero1", 64, 256),
    ("gpt-small", "zero2", 2, 256), ("gpt-small", "zero3", 2, 256),
    ("gpt-small", "zero3", 64, 256), ("llama-8b", "zero3", 4096, 256),
    ("llama-8b", "zero3", 4096, 8192),
)  # fmt: skip


def peak_verdict(result) -> str:
    """yes / NO where the peak is compared (PEAK_COMPARED), "not compared" elsewhere."""
    if result.row.candidate.strategy not in PEAK_COMPARED:
        return "not compared"
    return "NO" if result.peak_differences() else "yes"


def terms() -> int:
    """Per case of TERM_CASES, rank 0's peak term by term ([Note: peak terms])."""
    print("| model | strategy | ranks | tokens | term | MB at the peak | MB planned | gap MB |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for model, strategy, n, tokens in TERM_CASES:
        result = dry_run(model, ranks=n, strategy=strategy, precision="bf16-params",
                         seq_len=tokens, roles=[0])  # fmt: skip
        run, row = result.runs[0], result.row
        gap = run.peak / row.peak_bytes - 1
        for term in peak_terms(run.peak_terms, row):
            print(f"| {model} | {strategy} | {n} | {tokens} | {term.name} | "
                  f"{term.engine / 1e6:.3f} | {term.plan / 1e6:.3f} | {term.gap / 1e6:+.3f} |")  # fmt: skip
        print(f"| {model} | {strategy} | {n} | {tokens} | **peak** | {run.peak / 1e6:.3f} | "
              f"{row.peak_bytes / 1e6:.3f} | {gap:+.1%} |", flush=True)  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,gpt-medium,llama-8b")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--terms", action="store_true", help="the peak term by term instead")
    args = parser.parse_args()
    if args.terms:
        return terms()
    worlds = [int(n) for n in args.worlds.split(",")]
    print(
        "| model | layout | ranks | roles | held GB engine / plan (rank 0) | collectives "
        "MB engine / plan | agrees | peak GB meta / plan (gap) | peak within 1% | s |"
    )
    print("|---|---|---:|---|---|---|---|---|---|---:|")
    failed = 0
    for model in args.models.split(","):
        for name in args.layouts.split(","):
            strategy, shard, tp = LAYOUTS[name]
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
                      f"{result.row.peak_bytes / 1e9:.4f} ({first.peak / result.row.peak_bytes - 1:+.2%}) | "
                      f"{peak_verdict(result)} | {seconds:.1f} |", flush=True)  # fmt: skip
                for line in result.differences() + result.peak_differences():
                    print(f"  DIFFERS: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

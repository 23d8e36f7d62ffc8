"""`dataparallel plan --dry-run`'s output: the engine's numbers beside the plan's, as a text
table (`render`) or JSON (`as_json`, with `--json`) ([Note: dry run of a plan] in dry_run.py)."""

from __future__ import annotations

import json

from .dry_run import PEAK_COMPARED, PEAK_TOLERANCE, DryRun, RoleRun, tensor_parallel_collectives
from .peak_terms import peak_terms
from .render import plan_fields


def as_json(dry: DryRun) -> str:
    """The plan's JSON (`plan --json`: the same top-level fields, `rows` holding this
    candidate's row alone) and `dry_run`: one entry per role, the differences, and whether
    they agree."""
    differences = dry.differences() + dry.peak_differences()
    return json.dumps(
        {
            **plan_fields(dry.plan),
            "rows": [dry.row.to_dict(dry.plan.hardware)],
            "dry_run": {
                "label": dry.label,
                "roles": [_role(run, dry.row) for run in dry.runs],
                "peak_compared": dry.row.candidate.strategy in PEAK_COMPARED,
                "peak_tolerance": PEAK_TOLERANCE,
                "differences": differences,
                "agrees": not differences,
            },
        },
        indent=1,
    )


def _role(run: RoleRun, row) -> dict:
    """One role's rows: its held terms, peak, collectives and times beside the plan's (bytes;
    `peak_bytes` 0 and no `peak_terms` where the peak was not measured)."""
    keys = sorted(set(run.collectives) | set(run.planned_collectives))
    return {
        "rank": run.role.rank,
        "shard_rank": run.role.shard_rank,
        "why": list(run.role.why),
        "held_bytes": dict(run.held),
        "planned_bytes": {k: run.planned[k] for k in run.held},
        "peak_bytes": run.peak,
        "peak_terms": [
            {"term": t.name, "engine_bytes": t.engine, "plan_bytes": t.plan, "gap_bytes": t.gap}
            for t in (peak_terms(run.peak_terms, row) if run.peak else [])
        ],
        "collectives": [
            {
                "kind": kind,
                "group_size": size,
                "engine_bytes": run.collectives.get((kind, size), (0, 0))[0],
                "engine_calls": run.collectives.get((kind, size), (0, 0))[1],
                "plan_bytes": run.planned_collectives.get((kind, size), (0, 0))[0],
                "plan_calls": run.planned_collectives.get((kind, size), (0, 0))[1],
            }
            for kind, size in keys
        ],
        "control": [
            {"kind": kind, "group_size": size, "bytes": b, "calls": n}
            for (kind, size), (b, n) in sorted(run.control.items())
        ],
        "seconds": dict(run.seconds),
    }


def render(dry: DryRun) -> str:
    """The engine's numbers beside the plan's, per role, and the differences."""
    gb = 1e9
    lines = [
        f"dry run: {dry.label} over {dry.ranks} ranks (fake process group, NCCL's code "
        "paths; meta tensors)"
    ]
    lines.append(f"{'rank':>6} {'role':<40} {'term':<21} {'engine GB':>12} {'plan GB':>12}")
    for run in dry.runs:
        why = ", ".join(run.role.why)
        for k in run.held:
            lines.append(
                f"{run.role.rank:>6} {why:<40} {k:<21} {run.held[k] / gb:>12.6f} "
                f"{run.planned[k] / gb:>12.6f}"
            )
            why = ""
    for run in (run for run in dry.runs if run.peak):
        gap = run.peak / dry.row.peak_bytes - 1 if dry.row.peak_bytes else 0.0
        compared = dry.row.candidate.strategy in PEAK_COMPARED
        how = (
            f"compared within {PEAK_TOLERANCE:.0%}"
            if compared
            else "not compared: the plan "
            "does not model the gradient buffers in flight at the peak yet, docs/plan.md"
        )
        lines.append(
            f"rank {run.role.rank}: peak {run.peak / gb:.6f} GB (meta storages alive "
            f"at once in the step), plan {dry.row.peak_bytes / gb:.6f} GB ({gap:+.2%}; "
            f"{how})"
        )
        lines.append(
            f"  {'peak term ([Note: peak terms])':<34} {'engine GB':>12} {'plan GB':>12} "
            f"{'gap':>12}"
        )
        for term in peak_terms(run.peak_terms, dry.row):
            lines.append(
                f"  {term.name:<34} {term.engine / gb:>12.6f} {term.plan / gb:>12.6f} "
                f"{term.gap / gb:>+12.6f} GB"
            )
    lines.append(
        f"{'collective':<16} {'ranks':>6} {'engine MB':>12} {'calls':>6} "
        f"{'plan MB':>12} {'calls':>6}"
    )
    first = dry.runs[0]
    for key in sorted(set(first.collectives) | set(first.planned_collectives)):
        got = first.collectives.get(key, (0, 0))
        want = first.planned_collectives.get(key, (0, 0))
        lines.append(
            f"{key[0]:<16} {key[1]:>6} {got[0] / 1e6:>12.3f} {got[1]:>6} "
            f"{want[0] / 1e6:>12.3f} {want[1]:>6}"
        )
    for c in tensor_parallel_collectives(dry.row):
        lines.append(
            f"{c.what} ({c.kind} over {c.group.size} ranks): {c.buffer_bytes / 1e6:.3f} "
            "MB planned, not run (DTensor's, not the data-parallel engine's)"
        )
    for key, (b, n) in sorted(first.control.items()):
        lines.append(f"{key[0]:<28} over {key[1]} ranks: {b} B in {n} calls (not planned)")
    for run in dry.runs:
        t = run.seconds
        lines.append(
            f"rank {run.role.rank}: engine Python time: parallelize "
            f"{t['parallelize']:.2f} s, build_optimizer {t['build_optimizer']:.2f} s, "
            f"first step {t['first step']:.2f} s, step {t['step']:.2f} s (meta forward "
            "and backward included)"
        )
    diffs = dry.differences() + dry.peak_differences()
    lines += [f"DIFFERS: {d}" for d in diffs] or [
        "agrees: held bytes and collectives equal the plan"
        + (
            f", the peak within {PEAK_TOLERANCE:.0%}"
            if dry.row.candidate.strategy in PEAK_COMPARED
            else ""
        )
    ]
    return "\n".join(lines)

"""A plan as a text table (the CLI's default) or JSON rows (`--json`)."""

from __future__ import annotations

import json

from .planner import Plan
from .whole_parameters import describe

GB = 1e9


def plan_fields(p: Plan) -> dict:
    """What a plan was made for: the top-level fields of `--json` (the dry run's too)."""
    return {
        "model": p.model.name,
        "params": p.model.params,
        **({"frozen_params": p.model.frozen} if p.model.frozen else {}),
        "ranks": p.inputs.ranks,
        "tp": p.inputs.tp,
        "hardware": p.hardware.name,
    }


def as_json(p: Plan) -> str:
    return json.dumps(
        {
            **plan_fields(p),
            "rows": [r.to_dict(p.hardware) for r in p.rows],
            "recommendation": p.best.candidate.label if p.best else None,
            "reason": p.reason,
            **({"whole_parameters": _whole_json(p)} if p.whole else {}),
            **({"outer": {k: vars(o) for k, o in outer.items()}} if (outer := _outer(p)) else {}),
        },
        indent=1,
    )


def _whole_json(p: Plan) -> dict:
    sharded = [r for r in p.rows if r.candidate.strategy in ("zero1", "zero2", "zero3")]
    owners = {}
    for r in sharded:
        busiest, even, ownership = p.whole.per_rank(r.candidate.shard_size)
        owners[r.candidate.label] = {
            "busiest_bytes": busiest,
            "even_bytes": even,
            "idle_ranks": ownership.idle,
        }
    muon = p.whole.muon
    return {
        "optimizer": p.whole.optimizer,
        "state_bytes_per_param": p.whole.state_bytes_per_param,
        "owners": owners,
        **(
            {
                "muon": {
                    "distributed_share": muon.distributed_share,
                    "ddp_share": muon.ddp_share,
                    "verdict": muon.verdict(),
                }
            }
            if muon
            else {}
        ),
    }


def _world(p: Plan) -> str:
    x = p.inputs
    return (
        f"{x.ranks} ranks"
        if x.tp == 1
        else f"{x.ranks} ranks = dp {x.parallel_layout().data_size} x tp {x.tp}"
    )


def as_table(p: Plan) -> str:
    """Memory in GB (1e9 bytes), traffic in GB per rank per step, times in ms."""
    head = (
        f"{p.model.name}: {p.model.params:,} parameters{' per rank' if p.inputs.tp > 1 else ''}"
        f"{f' trained, {p.model.frozen:,} frozen (LoRA)' if p.model.frozen else ''}, {_world(p)}, "
        f"{p.inputs.precision}, micro-batch {p.inputs.micro_batch} x {p.inputs.accumulation}, "
        f"{p.hardware.name}"
    )
    columns = (
        "strategy",
        "params",
        "grads",
        "optim",
        "masters",
        "buckets",
        "resid",
        "outer",
        "activ",
        "held",
        "peak",
        "sent",
        "compute",
        "exposed",
        "step",
        "tok/s/rank",
        "fits",
    )
    lines = [head, "memory GB per rank (1e9 bytes); sent GB per rank per step; times ms", ""]
    rows = []
    for r in p.rows:
        m = r.memory
        rows.append(
            [r.candidate.label]
            + [
                f"{v / GB:.4g}"
                for v in (
                    m.params,
                    m.grads,
                    m.optimizer,
                    m.masters,
                    m.buckets,
                    m.residuals,
                    m.outer,
                    r.activations,
                    r.held_bytes,
                    r.peak_bytes,
                    r.sent_bytes,
                )
            ]
            + [f"{v * 1e3:.4g}" for v in (r.compute_s, r.exposed_s, r.step_s)]
            + [f"{r.tokens_per_s:,.0f}", "yes" if r.fits else "NO"]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    for row in [columns, *rows]:
        lines.append("  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)))
    if p.whole is not None:
        lines += ["", *describe(p.whole, p.rows, p.inputs.masters)]
    outer = _outer(p)
    if outer:
        lines += ["", *(f"{label}: {o.describe()}" for label, o in outer.items())]
    lines += ["", ("recommended: " if p.best else "") + p.reason]
    return "\n".join(lines)


def _outer(p: Plan) -> dict:
    """DiLoCo's outer settings per DiLoCo row, as the job would use them ([Note: the outer
    learning rate] in averaging/outer_settings.py)."""
    return {
        r.candidate.label: p.inputs.outer(r.candidate.shard_size)
        for r in p.rows
        if r.candidate.strategy == "diloco"
    }

"""`dataparallel plan --dry-run`: the real engine for the ranks of a large world that differ,
in one process, beside the analytic plan.

[Note: dry run of a plan] For one candidate (a strategy on a mesh) the planner predicts what
rank 0 of a shard group holds and what a step sends. The dry run runs, for each *role* (a
shard-group rank whose share of the layout differs: the first, the last, the first whose
shard ends in padding, the first that holds nothing of some parameter), `dp.init_fake` for
that rank of the world ([Note: dry run] in comm/dry.py), the model built on the meta device,
`dp.parallelize` with the planner's own policy (`policy_of`), `dp.build_optimizer` and two
training steps (the plan is the steady state: the second is measured), and reads from the engine's own structures: `dp.memory_report` (parameters,
gradients, optimizer state, fp32 masters; Adam's 4-byte `step` per tensor set apart, as the
footprint does not count it; under ZeRO-3 the largest unit a gather allocated, the buffer in
flight on top), every collective of the step (its kind, bytes and group, as the
comm layer's tracer records it; the used-parameter flags apart), and the Python time of each
phase. It compares them with the policy's footprint for that rank, and the step's
collectives with the plan's, and names every difference. Every other rank of the shard group
holds what its layout gives (`ShardLayout.pieces`), which the footprint computes for it: the
roles are the ranks at which that function's cases change.

The fake backend's name is neither "gloo" nor "nccl": the comm layer takes NCCL's paths
(`Comm.pairwise` off, `sharded_reduce` a reduce-scatter), and the plan is made for the
`h100-node` profile, NCCL's. A dry run does not see NCCL's own buffers, the allocator's
fragmentation, data-dependent control flow (a skipped step, unused parameters, a rank that
found an inf) or the network; its peak is the meta storages alive at once ([Note: meta peak] in
live_bytes.py), printed beside the plan's term by term ([Note: peak terms] in peak_terms.py)
and, for DDP and ZeRO-1 (PEAK_COMPARED), compared within PEAK_TOLERANCE (1%): the plan does not
model ZeRO-2's and ZeRO-3's gradient buffers in flight at backward's peak yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .dry_engine import (
    DRY_OPTIMIZERS,
    DRY_STRATEGIES,
    GATHERED,
    Role,
    RoleRun,
    run_role,
)
from .dry_roles import chosen_roles, role_ranks
from .errors import PlanError
from .inputs import plan_layout
from .lora import parse_lora
from .strategies import padded_frozen, policy_of

# the peak is compared where the plan models what is in flight at it ([Note: peak terms]):
# ZeRO-2's buckets and ZeRO-3's full gradients at backward's peak are not modelled yet
PEAK_COMPARED = ("ddp", "zero1")
PEAK_TOLERANCE = 0.01
TENSOR_PARALLEL = "activations"  # the plan's name for --tp's all-reduces (plan/tensor_parallel.py)


@dataclass
class DryRun:
    """A candidate's plan row (of `plan`, the planner's Plan of that candidate alone) and the
    engine's runs of its roles."""

    label: str
    ranks: int
    row: object
    plan: object
    runs: list[RoleRun] = field(default_factory=list)

    def differences(self) -> list[str]:
        """Held bytes and collectives that differ from the plan (the peak apart:
        `peak_differences`)."""
        return [d for run in self.runs for d in run.differences()]

    def peak_differences(self) -> list[str]:
        """Each measured peak more than PEAK_TOLERANCE from the plan's, where the plan models
        the peak of its strategy (PEAK_COMPARED; [Note: peak terms])."""
        planned = self.row.peak_bytes
        if self.row.candidate.strategy not in PEAK_COMPARED or not planned:
            return []
        return [
            f"rank {run.role.rank}: peak {run.peak} B in the dry run, {int(planned)} B planned "
            f"({run.peak / planned - 1:+.2%}, over {PEAK_TOLERANCE:.0%})"
            for run in self.runs
            if run.peak and abs(run.peak / planned - 1) > PEAK_TOLERANCE
        ]


def dry_run(
    model: str,
    *,
    ranks: int,
    strategy: str,
    shard_size: int | None = None,
    tp: int = 1,
    precision: str = "fp32",
    optimizer: str = "adamw",
    micro_batch: int = 1,
    seq_len: int | None = None,
    roles: list[int] | None = None,
    peak: bool = True,
    lora: str = "",
) -> DryRun:
    """The plan of `strategy` on shard groups of `shard_size` (default: every data rank) for
    built-in `model` over `ranks` ranks, and the engine's dry run of each role ([Note: dry run
    of a plan]); `roles`: shard-group ranks to run instead of the ones that differ; `peak`:
    measure the step's peak of meta storages ([Note: meta peak], a pass over the live storages
    per operator: off, the step runs faster and `RoleRun.peak` is 0); `lora`: a LoRA fine-tune
    ([Note: planner LoRA]): the base built frozen in the compute dtype, its adapters fp32 as
    peft leaves them, the frozen bytes counted in the planned parameters, and under ZeRO-3
    the frozen units' gathers in the planned collectives and the largest gathered unit)."""
    from .api import plan

    if not isinstance(model, str):
        raise PlanError("--model", "a dry run needs a built-in model", "give --model NAME")
    if strategy not in DRY_STRATEGIES:
        raise PlanError(
            "--strategy", f"{strategy!r} has no dry run", f"give one of {', '.join(DRY_STRATEGIES)}"
        )
    if str(optimizer) not in DRY_OPTIMIZERS:
        bare = str(optimizer).replace(".", "", 1).isdigit()
        why = "bytes per parameter name no optimizer to run" if bare else "has no dry run"
        raise PlanError(
            "--optimizer", f"{optimizer!r}: {why}", f"give one of {', '.join(DRY_OPTIMIZERS)}"
        )
    s = plan_layout(ranks, tp, 0 if strategy == "ddp" else shard_size or 0, strategy).shard
    result = plan(
        model,
        ranks=ranks,
        strategies=[strategy],
        shard_sizes=[s],
        tp=tp,
        precision=precision,
        optimizer=optimizer,
        micro_batch=micro_batch,
        seq_len=seq_len,
        hardware="h100-node",
        lora=lora,
    )
    row = next(r for r in result.rows if r.candidate.shard_size == s or strategy == "ddp")
    out = DryRun(row.candidate.label + (f" tp={tp}" if tp > 1 else ""), ranks, row, result)
    x = result.inputs
    shapes = result.model.param_shapes
    policy = policy_of(row.candidate, x)
    chosen = roles if roles is not None else role_ranks(policy, shapes, s)
    for shard_rank, why in chosen_roles(policy, shapes, s, chosen):
        rank = global_rank(shard_rank, s, tp)
        role = Role(rank, shard_rank, why)
        planned = footprint_of(policy, shapes, s, x.optimizer_bytes, shard_rank)
        planned["params"] += int(row.memory.frozen)  # [Note: planner LoRA]
        if GATHERED in planned and result.model.frozen_units:  # a frozen unit may be larger
            widest = max(padded_frozen(result.model, s)) * x.param_bytes
            planned[GATHERED] = max(planned[GATHERED], widest)
        run = run_role(
            model,
            role,
            ranks=ranks,
            tp=tp,
            shard_size=s,
            policy=policy,
            optimizer=str(optimizer),
            micro_batch=micro_batch,
            seq_len=result.model.seq_len,
            peak=peak,
            lora=parse_lora(lora),
            base_dtype=x.compute,
        )
        run.planned = planned
        run.planned_collectives = planned_collectives(row)
        out.runs.append(run)
    return out


def global_rank(shard_rank: int, shard_size: int, tp: int) -> int:
    """The world rank that is `shard_rank` of the first shard group (dp ranks are `tp` apart:
    [Note: planner tensor parallelism])."""
    return shard_rank * tp


def footprint_of(policy, shapes, s: int, optimizer_bytes: float, rank: int) -> dict[str, int]:
    from ..strategies import DDP, ZeRO3

    if isinstance(policy, DDP):
        f = policy.footprint(shapes, optimizer_bytes=optimizer_bytes)
    else:
        f = policy.footprint(
            shapes, shard_size=s, pairwise=False, optimizer_bytes=optimizer_bytes, rank=rank
        )
    out = {
        "params": int(f.params),
        "grads": int(f.grads),
        "optimizer_state": int(f.optimizer + f.masters),
        "master_params": int(f.masters),
    }
    if isinstance(policy, ZeRO3):
        out[GATHERED] = int(max(f.gathers))  # in flight: the largest unit gathered
    return out


def planned_collectives(row) -> dict[tuple[str, int], tuple[int, int]]:
    """The plan's collectives of one step by (kind, group size), as the engine's are keyed;
    left out: those over one rank (DDP with masters is ZeRO-1 on shard groups of one rank,
    whose all-gather moves nothing and which the comm layer skips) and tensor parallelism's
    activation all-reduces (DTensor's, which the dry run does not run: it runs the data-
    parallel engine on the part of the model a rank holds; `tensor_parallel_collectives`)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for c in row.memory.collectives:
        if c.group.size == 1 or c.what.startswith(TENSOR_PARALLEL):
            continue
        key = (c.kind, c.group.size)
        b, n = out.get(key, (0, 0))
        out[key] = (b + int(c.buffer_bytes), n + int(c.calls))
    return out


def tensor_parallel_collectives(row) -> list:
    """The plan's tensor-parallel activation all-reduces (not run by the dry run)."""
    return [c for c in row.memory.collectives if c.what.startswith(TENSOR_PARALLEL)]

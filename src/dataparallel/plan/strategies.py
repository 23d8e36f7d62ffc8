"""Per strategy: the bytes one rank holds and the collectives it issues per step.

[Note: planner memory] The planner keeps no model of its own of what a strategy allocates:
each candidate's policy (`policy_of`: the strategy's own defaults, the precision policy the
`--precision` name means, `--bucket-mb` when given) reports its footprint from the planners
its strategy runs ([Note: footprint] in strategies/parts/footprint.py): DDP's and ZeRO-1/2's
`plan_buckets` with the policy's bucket sizes (ZeRO-2's 4 MiB is its own default), padded to
the shard group; ZeRO-3's units from `plan_units`, packed by `ShardLayout.pack`; the reducer's
`MAX_IN_FLIGHT` and ZeRO-3's one reduction at a time for the buffers in flight; DDP with fp32
masters counted as ZeRO-1 on shard groups of one rank (docs/ddp.md). In the terms of
docs/zero.md and docs/zero3.md, Psi parameters, shard groups of S ranks, p the compute dtype's
bytes, g the gradient buckets', K the optimizer's bytes per parameter, that comes to
- DDP: p Psi parameters, g Psi gradients (the flat buckets), K Psi state; with fp32 masters
  ZeRO-1 on S = 1, so also a 4 Psi fp32 gradient and 4 Psi masters.
- ZeRO-1: p Psi, g Psi full buckets (+ 4 Psi / S fp32 gradient slice with masters), K Psi / S,
  masters 4 Psi / S.
- ZeRO-2: p Psi, (4 if masters else g) Psi / S gradient slice, K Psi / S, 4 Psi / S masters;
  in flight: `MAX_IN_FLIGHT` + 1 buckets filling or reducing.
- ZeRO-3: shards only: (4 if masters else p) Psi / S parameters (the masters *are* the shard),
  same for gradients, K Psi / S; in flight: the root, the unit computing and the one
  prefetched, gathered in p, and two units' full gradients (one filling, one reducing).
- On gloo our reduce-scatters are pairwise and hold a receive buffer of (S-1)/S of each
  bucket (unit) reducing.
plus each bucket's (unit's) padding to a multiple of S; `tests/dist/test_footprint.py` holds it
against `dp.memory_report` to the byte. What the job adds around the strategy (compression
residuals, DiLoCo's outer state) and the collectives are modelled here, from the same
footprint's buckets and units.
The "zero-paper" layout is Table 1 of Rajbhandari et al. 2020: (2 + 2 + K) Psi for DDP,
2 Psi + 2 Psi + K Psi / N for stage 1, 2 Psi + (2 + K) Psi / N for stage 2, (2 + 2 + K) Psi / N
for stage 3, with K = 12 for mixed-precision Adam (fp32 masters, momentum and variance).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..strategies import DDP, POLICIES, PRECISIONS, padded_numel
from ..strategies import Footprint as RankFootprint
from .collectives import Collective, compressed_bytes, span
from .hardware import HardwareProfile
from .inputs import PlanInputs
from .model import ModelShape
from .tensor_parallel import activation_all_reduces

# bytes per value of DiLoCo's outer gradients on the wire (None: fp32)
OUTER_VALUE_BYTES = {None: 4, "bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5}


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to train: a strategy on a mesh, maybe with a compressor.

    strategy: ddp, zero1, zero2, zero3 or diloco (whose inner steps run zero3 within shard
        groups of S ranks, S = 1 included, as the trainer runs its strategy in each replica).
    shard_size: S.
    compress: the compressor on the cross-replica all-reduce, or "none".
    """

    strategy: str
    shard_size: int
    compress: str = "none"

    @property
    def label(self) -> str:
        text = self.strategy if self.strategy == "ddp" else f"{self.strategy} S={self.shard_size}"
        return text if self.compress == "none" else f"{text} +{self.compress}"


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """A candidate's bytes per rank: its strategy's own, and what the job adds around it.

    rank: the policy's footprint ([Note: planner memory]): params, grads, optimizer, masters;
        `buckets` here is its buffers in flight (gathered: the part of them that is ZeRO-3's
        gathered parameters, present while the activations are; the rest are gradient
        buffers, in flight once backward has freed most activations).
    residuals: error-feedback residuals. outer: DiLoCo's fp32 snapshot and momentum.
    collectives: what one step sends.
    frozen: bytes of frozen parameters held between steps (a LoRA base, [Note: planner
        LoRA] in lora.py), in `params`; frozen_gathered: ZeRO-3's frozen units gathered at
        the peak, in `gathered` and `buckets`.
    """

    rank: RankFootprint
    residuals: float = 0.0
    outer: float = 0.0
    collectives: list[Collective] = field(default_factory=list)
    frozen: float = 0.0
    frozen_gathered: float = 0.0

    params = property(lambda self: self.rank.params + self.frozen)
    grads = property(lambda self: self.rank.grads)
    optimizer = property(lambda self: self.rank.optimizer)
    masters = property(lambda self: self.rank.masters)
    buckets = property(lambda self: self.rank.in_flight + self.frozen_gathered)
    gathered = property(lambda self: self.rank.gathered + self.frozen_gathered)

    @property
    def model_state(self) -> float:
        return self.rank.model_state + self.frozen


def policy_of(c: Candidate, x: PlanInputs):
    """The policy candidate `c` trains with: its strategy's own defaults (DiLoCo's inner
    steps: ZeRO-3), the precision `x.precision` names, and `x.bucket_mb` when given."""
    name = "zero3" if c.strategy == "diloco" else c.strategy
    options = {
        "precision": PRECISIONS[x.precision].policy
    }  # the engine's ([Note: mixed precision])
    if x.bucket_mb is not None and name != "zero3":
        options["bucket_mb"] = x.bucket_mb
    return POLICIES[name](**options)


def footprint(c: Candidate, m: ModelShape, x: PlanInputs, hw: HardwareProfile) -> Footprint:
    """[Note: planner memory] and the collectives of one step, for candidate `c`."""
    layout = x.parallel_layout(c.shard_size, c.strategy)  # [Note: layout]
    n, s, t = layout.data_size, layout.shard, x.tp  # dp groups: ranks t apart
    policy = policy_of(c, x)
    if isinstance(policy, DDP):
        held = policy.footprint(m.param_shapes, optimizer_bytes=x.optimizer_bytes)
        s = 1
    else:  # our comm's reduce-scatters are pairwise on gloo (`parallelize(pairwise=None)`)
        held = policy.footprint(
            m.param_shapes,
            shard_size=s,
            pairwise=hw.backend == "gloo",
            optimizer_bytes=x.optimizer_bytes,
        )
    world = span(n, t, x.ranks, hw.ranks_per_node)
    shard = span(s, t, x.ranks, hw.ranks_per_node)
    replicas = world if s == 1 else span(layout.replicas, s * t, x.ranks, hw.ranks_per_node)
    grads, calls = sum(held.reductions), len(held.reductions)
    f = Footprint(rank=held)
    if c.strategy in ("zero3", "diloco"):
        f.collectives.extend(_zero3(held, shard, replicas, x.accumulation))
        if c.strategy == "diloco":
            f = _diloco(f, c, float(m.params), s, x, replicas)
    elif not held.gathers:  # replicated: DDP's all-reduce of every bucket
        f.collectives.append(
            Collective(
                what="gradients", kind="all_reduce", buffer_bytes=grads, group=world, calls=calls
            )
        )
    else:  # ZeRO-1/2, and DDP with masters (ZeRO-1 on S = 1: its replicas are the world)
        f.collectives.extend(_sharded_reduce(grads, shard, replicas, calls))
        f.collectives.append(
            Collective(
                what="parameters",
                kind="all_gather",
                buffer_bytes=sum(held.gathers),
                group=shard,
                calls=len(held.gathers),
                window="none",
            )
        )
    f = _compress(f, c, m, x, world if c.strategy == "ddp" else replicas)
    itemsize = 2 if x.autocast else x.param_bytes
    f.collectives.extend(
        activation_all_reduces(
            x.tp,
            m.layers,
            m.width,
            m.seq_len * x.micro_batch,
            itemsize,
            x.accumulation,
            x.ranks,
            hw.ranks_per_node,
        )
    )
    psi, k = float(m.params), x.optimizer_bytes
    if x.layout == "zero-paper":
        return _paper(f, c.strategy, psi, n, k)
    return _frozen(f, policy, m, x, shard) if m.frozen_units else f


def _frozen(f: Footprint, policy, m: ModelShape, x: PlanInputs, shard) -> Footprint:
    """[Note: planner LoRA] The frozen base in the compute dtype: whole under DDP and ZeRO-1/2;
    under ZeRO-3 a shard of each unit's frozen part (a unit of its own, split from the trained
    part), at the peak the root's and the gathered units' frozen parts (`gathered_units` as the
    policy's footprint counts them), and their all-gathers: each frozen part in forward and
    again in backward, but the root's (it stays gathered)."""
    itemsize = x.param_bytes
    if not isinstance(policy, POLICIES["zero3"]):
        return replace(f, frozen=m.frozen * itemsize)
    s = shard.size
    units = padded_frozen(m, s)
    count = 1 + int(policy.prefetch) if policy.reshard_after_forward else len(units)
    gathered = (units[0] + sum(sorted(units[1:], reverse=True)[:count])) * itemsize
    collectives = list(f.collectives)
    if s > 1:
        forward, calls = sum(units) * itemsize, sum(1 for u in units if u)
        again = forward - units[0] * itemsize
        micro = x.accumulation
        gather = {"kind": "all_gather", "group": shard}
        collectives += [
            Collective(
                what="frozen parameters (forward)",
                buffer_bytes=forward * micro,
                calls=calls * micro,
                window="forward",
                **gather,
            ),
            Collective(
                what="frozen parameters (backward)",
                buffer_bytes=again * micro,
                calls=(calls - bool(units[0])) * micro,
                **gather,
            ),
        ]
    held = sum(units) // s * itemsize
    return replace(f, frozen=held, frozen_gathered=gathered, collectives=collectives)


def padded_frozen(m: ModelShape, shard_size: int) -> list[int]:
    """Each ZeRO-3 unit's frozen elements, padded to split over the shard group."""
    return [padded_numel(u, shard_size) for u in m.frozen_units]


def _sharded_reduce(grad_bytes, shard, replicas, calls) -> list[Collective]:
    """Reduce-scatter within the shard group, all-reduce of the shard across replicas."""
    out = []
    if shard.size > 1:
        out.append(
            Collective(
                what="gradients",
                kind="reduce_scatter",
                buffer_bytes=grad_bytes,
                group=shard,
                calls=calls,
            )
        )
    if replicas.size > 1:
        out.append(
            Collective(
                what="gradient shards",
                kind="all_reduce",
                buffer_bytes=grad_bytes / shard.size,
                group=replicas,
                calls=calls,
            )
        )
    return out


def _zero3(held: RankFootprint, shard, replicas, micro: int) -> list[Collective]:
    """Each unit gathered in forward, and again in backward but the root and the unit that
    ran last in forward (both stay gathered, docs/zero3.md); reduced once per step."""
    out = []
    # a unit with nothing trained (a LoRA base's frozen part) has no gather or reduction here
    gathers, reductions = sum(1 for g in held.gathers if g), sum(1 for r in held.reductions if r)
    if shard.size > 1:
        forward = sum(held.gathers)
        again = forward - held.gathers[0] - (held.gathers[-1] if len(held.gathers) > 1 else 0)
        out += [
            Collective(
                what="parameters (forward)",
                kind="all_gather",
                buffer_bytes=forward * micro,
                group=shard,
                calls=gathers * micro,
                window="forward",
            ),
            Collective(
                what="parameters (backward)",
                kind="all_gather",
                buffer_bytes=again * micro,
                group=shard,
                calls=gathers * micro,
            ),
        ]
    return out + _sharded_reduce(sum(held.reductions), shard, replicas, reductions)


def _diloco(f: Footprint, c, psi, s, x: PlanInputs, replicas) -> Footprint:
    """DiLoCo (Douillard et al. 2023) as `dataparallel train --diloco H` runs it (streaming,
    Liu et al. 2025): no cross-replica gradient traffic; each of F fragments all-reduces its
    outer gradient every H steps, staggered by H / F, behind tau inner steps ([Note: the DiLoCo
    recipe]); fp32, bf16 or 1 (int8, fp8) or 1/2 (int4) byte per value + a fp32 scale per
    1024-value block. Outer state: the last synchronised fp32 parameters and a fp32 momentum
    buffer, sharded by S, and with a quantised format the error-feedback residuals (the
    sender's, whole, and the chunk owner's, 1/R of it). The streamed warm-up (the first
    steps average a fragment each step) is not in this steady state."""
    streaming = x.streaming()
    inner = [col for col in f.collectives if col.group is not replicas]
    value_bytes = OUTER_VALUE_BYTES[streaming.compress]
    quantised = streaming.compress in ("int8", "fp8", "int4")
    payload = psi / s / streaming.fragments * (value_bytes + (4 / 1024 if quantised else 0))
    outer = Collective(
        what="outer deltas",
        kind="all_reduce",
        buffer_bytes=payload,
        group=replicas,
        window="steps",
        overlap_steps=streaming.overlap,
        every=x.diloco_steps / streaming.fragments,
    )
    residual = 4 * psi / s * (1 + 1 / replicas.size) if quantised and replicas.size > 1 else 0
    return Footprint(
        rank=f.rank,
        outer=8 * psi / s,
        residuals=residual,
        collectives=inner + ([outer] if replicas.size > 1 else []),
    )


def _compress(f: Footprint, c: Candidate, m: ModelShape, x: PlanInputs, target) -> Footprint:
    """The compressor acts where compression/hook.py puts it ([Note: where compression acts]):
    on the cross-replica all-reduce, or, for a sharded strategy on a 1-D mesh, on the
    gradients' reduce-scatter itself. With error feedback each rank keeps a fp32 residual of
    what it sends (full size on a 1-D mesh, 1/S on a 2-D one); int8/fp8 on a whole buffer also
    keep the owner's residual of their second stage (1/k of it)."""
    if c.compress == "none" or c.strategy == "diloco":
        return f
    one_d = c.strategy != "ddp" and target.size == 1
    out, residual = [], 0.0
    for col in f.collectives:
        whole = col.kind == "all_reduce" and col.group is target
        sharded = one_d and col.kind == "reduce_scatter" and col.what == "gradients"
        if whole or sharded:
            numel = col.buffer_bytes / x.grad_bytes
            kind, size, feedback = compressed_bytes(
                c.compress, x.compress_arg, numel, m.matrices, m.params
            )
            if sharded and kind == "all_reduce" and c.compress in ("int8", "fp8", "bf16"):
                kind = "reduce_scatter"  # quantised chunks to their owners only
            size *= col.group.size if kind == "all_gather" else 1
            second = whole and c.compress in ("int8", "fp8")
            residual += 4 * numel * (1 + (1 / col.group.size if second else 0)) if feedback else 0
            col = Collective(
                what=f"{col.what} ({c.compress})",
                kind=kind,
                buffer_bytes=size,
                group=col.group,
                calls=col.calls,
                window=col.window,
            )
        out.append(col)
    return Footprint(rank=f.rank, residuals=residual, outer=f.outer, collectives=out)


def _paper(f: Footprint, name: str, psi: float, n: int, k: float) -> Footprint:
    """Table 1 of the ZeRO paper: 16-bit parameters and gradients, K bytes of optimizer
    state (masters included) per parameter, partitioned over N; model states only."""
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}
    sp, sg, so = shard.get(name, (n, n, n))
    held = RankFootprint(params=2 * psi / sp, grads=2 * psi / sg, optimizer=k * psi / so)
    return Footprint(rank=held, collectives=f.collectives)

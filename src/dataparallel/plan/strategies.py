"""Per strategy: the bytes one rank holds and the collectives it issues per step.

[Note: planner memory] Terms follow how our strategies allocate (docs/zero.md, docs/zero3.md),
Psi parameters, shard groups of S ranks (S = N on a 1-D mesh, S = 1 for DDP), p the compute
dtype's bytes, g the gradient buckets' bytes, K the optimizer's bytes per parameter:
- DDP: p Psi parameters, g Psi gradients (the flat buckets), K Psi state; with fp32 masters
  it is ZeRO-1 on S = 1 (docs/ddp.md), so also a 4 Psi fp32 gradient and 4 Psi masters.
- ZeRO-1: p Psi, g Psi full buckets (+ 4 Psi / S fp32 gradient slice with masters), K Psi / S,
  masters 4 Psi / S.
- ZeRO-2: p Psi, (4 if masters else g) Psi / S gradient slice, K Psi / S, 4 Psi / S masters;
  in flight: three buckets filling or reducing (`MAX_IN_FLIGHT` + 1 in zero.py).
- ZeRO-3: shards only: (4 if masters else p) Psi / S parameters (the masters *are* the shard),
  same for gradients, K Psi / S; in flight: the root, the unit computing and the one
  prefetched, gathered in p, and two units' full gradients.
- On gloo our reduce-scatters are pairwise and hold a receive buffer of (S-1)/S of each of the
  two buckets (units) in flight.
The "zero-paper" layout is Table 1 of Rajbhandari et al. 2020: (2 + 2 + K) Psi for DDP,
2 Psi + 2 Psi + K Psi / N for stage 1, 2 Psi + (2 + K) Psi / N for stage 2, (2 + 2 + K) Psi / N
for stage 3, with K = 12 for mixed-precision Adam (fp32 masters, momentum and variance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .collectives import Collective, compressed_bytes, span
from .hardware import HardwareProfile
from .inputs import PlanInputs
from .model import ModelShape

MIB = 1024 * 1024
IN_FLIGHT = 2  # reductions in flight at once (zero.py's MAX_IN_FLIGHT)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to train: a strategy on a mesh, maybe with a compressor.

    strategy: ddp, zero1, zero2, zero3 or diloco (whose inner steps run zero3 within S,
        or plain local steps when S = 1).
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
    """Bytes one rank holds (held: between steps; in_flight: transient, at the step's peak).

    params, grads, optimizer, masters: model states. buckets: communication buffers in flight
        (gathered: the part of them that is ZeRO-3's gathered parameters, present while the
        activations are; the rest are gradient buffers, in flight once backward has freed
        most activations).
    residuals: error-feedback residuals. outer: DiLoCo's fp32 snapshot and momentum.
    """

    params: float
    grads: float
    optimizer: float
    masters: float
    buckets: float = 0.0
    gathered: float = 0.0
    residuals: float = 0.0
    outer: float = 0.0
    collectives: list[Collective] = field(default_factory=list)

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer + self.masters


def bucket_sizes(model: ModelShape, cap_bytes: float, itemsize: int) -> list[float]:
    """Bytes of each gradient bucket, planned as parts/buckets.py does (reverse order, the
    first one closing at 1 MiB)."""
    sizes, current = [], 0.0
    for numel in reversed(model.tensor_numels):
        current += numel * itemsize
        if current >= (cap_bytes if sizes else MIB):
            sizes.append(current)
            current = 0.0
    return sizes + ([current] if current else [])


def footprint(c: Candidate, m: ModelShape, x: PlanInputs, hw: HardwareProfile) -> Footprint:
    """[Note: planner memory] and the collectives of one step, for candidate `c`."""
    psi, n, s = float(m.params), x.ranks, c.shard_size
    p, g, k = x.param_bytes, x.grad_bytes, x.optimizer_bytes
    masters = 4 * psi / s if x.masters else 0.0
    gloo = hw.backend == "gloo"
    world = span(n, 1, n, hw.ranks_per_node)
    shard = span(s, 1, n, hw.ranks_per_node)
    replicas = span(n // s, s, n, hw.ranks_per_node)
    name = c.strategy
    if name == "ddp" and x.masters:  # ZeRO-1 on shard groups of one rank (docs/ddp.md)
        name, s, shard, replicas = "zero1", 1, span(1, 1, n, hw.ranks_per_node), world
        masters = 4 * psi
    buckets = bucket_sizes(m, (4 if name == "zero2" else x.bucket_mb) * MIB, g)
    biggest = max(buckets, default=0.0)
    receive = IN_FLIGHT * (s - 1) / s * biggest if gloo else 0.0
    grad_bytes, param_bytes = g * psi, p * psi
    micro = x.accumulation
    if name == "ddp":
        f = Footprint(params=p * psi, grads=g * psi, optimizer=k * psi, masters=0.0)
        f.collectives.append(Collective(what="gradients", kind="all_reduce",
                                        buffer_bytes=grad_bytes, group=world,
                                        calls=len(buckets)))  # fmt: skip
    elif name in ("zero1", "zero2"):
        slice_bytes = (4 if x.masters else g) * psi / s
        if name == "zero1":
            grads = g * psi + (slice_bytes if x.masters else 0.0)
            in_flight = receive
        else:
            grads = slice_bytes
            in_flight = sum(sorted(buckets)[-(IN_FLIGHT + 1) :]) + receive
        f = Footprint(params=p * psi, grads=grads, optimizer=k * psi / s, masters=masters,
                      buckets=in_flight)  # fmt: skip
        f.collectives.extend(_sharded_reduce(grad_bytes, shard, replicas, len(buckets)))
        f.collectives.append(Collective(what="parameters", kind="all_gather",
                                        buffer_bytes=param_bytes, group=shard,
                                        calls=len(buckets), window="none"))  # fmt: skip
    else:  # zero3, or diloco's inner steps
        f = _zero3(m, psi, s, p, g, k, x.masters, shard, replicas, micro, gloo)
        if name == "diloco":
            f = _diloco(f, c, psi, s, x, replicas)
    f = _compress(f, c, m, x, world if c.strategy == "ddp" else replicas)
    return _paper(f, c.strategy, psi, n, k) if x.layout == "zero-paper" else f


def _sharded_reduce(grad_bytes, shard, replicas, calls) -> list[Collective]:
    """Reduce-scatter within the shard group, all-reduce of the shard across replicas."""
    out = []
    if shard.size > 1:
        out.append(Collective(what="gradients", kind="reduce_scatter", buffer_bytes=grad_bytes,
                              group=shard, calls=calls))  # fmt: skip
    if replicas.size > 1:
        out.append(Collective(what="gradient shards", kind="all_reduce",
                              buffer_bytes=grad_bytes / shard.size, group=replicas,
                              calls=calls))  # fmt: skip
    return out


def _zero3(m, psi, s, p, g, k, masters, shard, replicas, micro, gloo) -> Footprint:
    units = sorted(m.unit_params)
    root, largest = m.unit_params[-1], units[-1]
    held = (4 if masters else p) * psi / s
    gathered = (root + 2 * largest) * p if s > 1 else 0.0
    in_flight = gathered + IN_FLIGHT * largest * g
    in_flight += IN_FLIGHT * (s - 1) / s * largest * g if gloo else 0.0
    f = Footprint(params=held, grads=held, optimizer=k * psi / s, masters=0.0,
                  buckets=in_flight, gathered=gathered)  # fmt: skip
    n_units = len(m.unit_params)
    if s > 1:
        # Backward re-gathers every unit but the root and the one that ran last in forward
        # (both stay gathered, docs/zero3.md).
        again = max(0.0, psi - root - (units[-2] if n_units > 1 else 0)) / psi
        f.collectives.extend([
            Collective(what="parameters (forward)", kind="all_gather", buffer_bytes=p * psi
                       * micro, group=shard, calls=n_units * micro, window="forward"),
            Collective(what="parameters (backward)", kind="all_gather", buffer_bytes=p * psi
                       * again * micro, group=shard, calls=n_units * micro),
        ])  # fmt: skip
    f.collectives.extend(_sharded_reduce(g * psi, shard, replicas, n_units))
    return f


def _diloco(f: Footprint, c, psi, s, x: PlanInputs, replicas) -> Footprint:
    """DiLoCo (Douillard et al. 2023): no cross-replica gradient traffic; every H steps an
    all-reduce of the fp32 parameter deltas (int8 + block scales when compressed); outer
    state: the last synchronised fp32 parameters and a fp32 momentum buffer, sharded by S."""
    inner = [col for col in f.collectives if col.group is not replicas]
    payload = psi / s * ((1 + 4 / 1024) if c.compress in ("int8", "fp8") else 4)
    outer = Collective(what="outer deltas", kind="all_reduce", buffer_bytes=payload,
                       group=replicas, window="none", every=x.diloco_steps)  # fmt: skip
    return Footprint(params=f.params, grads=f.grads, optimizer=f.optimizer, masters=f.masters,
                     buckets=f.buckets, gathered=f.gathered, outer=8 * psi / s,
                     collectives=inner + ([outer] if replicas.size > 1 else []))  # fmt: skip


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
            kind, size, feedback = compressed_bytes(c.compress, x.compress_arg, numel,
                                                    m.matrices, m.params)  # fmt: skip
            if sharded and kind == "all_reduce" and c.compress in ("int8", "fp8", "bf16"):
                kind = "reduce_scatter"  # quantised chunks to their owners only
            size *= col.group.size if kind == "all_gather" else 1
            second = whole and c.compress in ("int8", "fp8")
            residual += 4 * numel * (1 + (1 / col.group.size if second else 0)) if feedback else 0
            col = Collective(what=f"{col.what} ({c.compress})", kind=kind, buffer_bytes=size,
                             group=col.group, calls=col.calls, window=col.window)  # fmt: skip
        out.append(col)
    return Footprint(
        params=f.params,
        grads=f.grads,
        optimizer=f.optimizer,
        masters=f.masters,
        buckets=f.buckets,
        residuals=residual,
        outer=f.outer,
        collectives=out,
    )


def _paper(f: Footprint, name: str, psi: float, n: int, k: float) -> Footprint:
    """Table 1 of the ZeRO paper: 16-bit parameters and gradients, K bytes of optimizer
    state (masters included) per parameter, partitioned over N; model states only."""
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}
    sp, sg, so = shard.get(name, (n, n, n))
    return Footprint(params=2 * psi / sp, grads=2 * psi / sg, optimizer=k * psi / so,
                     masters=0.0, collectives=f.collectives)  # fmt: skip

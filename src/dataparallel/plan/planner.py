"""`plan`: per strategy, the bytes one rank holds, what it sends, how long a step takes, and
which strategy to pick. No process group, no allocation ([Note: activations] in model.py).

[Note: step time] compute = tokens x FLOPs per token / the profile's rate (x 4/3 with
activation checkpointing: one more forward) + the optimizer's parameters / its rate. Each
collective can hide behind the computation that runs while it is in flight (gradient
reductions and ZeRO-3's backward gathers behind backward, 2/3 of the FLOPs; ZeRO-3's forward
gathers behind forward, 1/3; ZeRO-1/2's parameter all-gather after the step behind nothing;
a streamed DiLoCo fragment's outer all-reduce behind its tau inner steps, whole steps of
forward and backward, none with tau = 0), at most `overlap` of that window: exposed = time -
min(time, overlap x window), summed per window. Step = compute + exposed communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile
from .inputs import PlanInputs
from .model import ModelShape
from .strategies import Candidate, Footprint, footprint
from .whole_parameters import WholeParameters

WINDOW_SHARE = {"forward": 1 / 3, "backward": 2 / 3, "none": 0.0}


@dataclass(frozen=True, kw_only=True)
class Row:
    """One candidate's plan.

    candidate: the strategy, its mesh and compressor.
    memory: the bytes per term ([Note: planner memory] in strategies.py).
    activations: bytes kept for backward by one micro-batch.
    working: the widest tensor backward works on, for one micro-batch (on top at the peak).
    held_bytes: bytes held between steps (model states, residuals, DiLoCo's outer state).
    transient: activations and backward's temporaries alive at the step's peak: the traced
        transient peak of one micro-batch times the micro-batches ([Note: transient peak] in
        model.py), or, untraced (a bare count, activation checkpointing), activations +
        working.
    peak_bytes: held + gathered parameters + the larger of the transient bytes and the
        working tensor with the gradient buffers in flight (backward frees the activations
        as the buffers fill).
    sent_bytes: bytes one rank sends per step, all collectives.
    compute_s, comm_s, exposed_s, step_s: [Note: step time].
    tokens_per_s: tokens one rank trains per second.
    fits: whether the peak fits the profile's memory.
    """

    candidate: Candidate
    memory: Footprint
    activations: float
    working: float
    transient: float
    held_bytes: float
    peak_bytes: float
    sent_bytes: float
    compute_s: float
    comm_s: float
    exposed_s: float
    step_s: float
    tokens_per_s: float
    fits: bool

    def to_dict(self, hw: HardwareProfile) -> dict:
        m = self.memory
        return {
            "strategy": self.candidate.strategy,
            "shard_size": self.candidate.shard_size,
            "compress": self.candidate.compress,
            "label": self.candidate.label,
            "model_state_bytes": m.model_state,
            "params_bytes": m.params,
            "grads_bytes": m.grads,
            "optimizer_bytes": m.optimizer,
            "masters_bytes": m.masters,
            "buckets_bytes": m.buckets,
            "residuals_bytes": m.residuals,
            "outer_state_bytes": m.outer,
            "activations_bytes": self.activations,
            "held_bytes": self.held_bytes,
            "peak_bytes": self.peak_bytes,
            "sent_bytes_per_step": self.sent_bytes,
            "collectives": [
                {
                    "what": c.what,
                    "kind": c.kind,
                    "group_size": c.group.size,
                    "sent_bytes_per_step": c.bytes_sent(),
                    "seconds_per_step": c.seconds(hw),
                    "calls": c.calls,
                    "every": c.every,
                }
                for c in m.collectives
            ],
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_s,
            "step_s": self.step_s,
            "tokens_per_s_per_rank": self.tokens_per_s,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Plan:
    """Every candidate's row, and the recommendation with its reason; `whole`: the owners'
    memory and Muon's compute under --optimizer muon|adafactor (whole_parameters.py)."""

    model: ModelShape
    hardware: HardwareProfile
    inputs: PlanInputs
    rows: list[Row]
    best: Row | None
    reason: str
    whole: WholeParameters | None = None


def candidates(x: PlanInputs, hw: HardwareProfile) -> list[Candidate]:
    """ddp, each sharded strategy on every shard size asked for, DiLoCo over single ranks and
    over nodes; each again with the compressor when one is given."""
    # the strategies run over "dp" ([Note: planner tensor parallelism])
    n = x.parallel_layout().data_size
    sizes = x.shard_sizes or tuple(s for s in range(2, n + 1) if n % s == 0)
    # S = 1 is DDP's layout; a sharded strategy on it only makes sense in a world of one.
    sizes = tuple(s for s in sizes if s > 1 or n == 1) or (n,)
    out = []
    for name in x.strategies:
        if name == "ddp":
            out.append(Candidate(strategy="ddp", shard_size=1))
        elif name == "diloco":
            node = min(hw.ranks_per_node, n)
            inner = {1, node} if n % node == 0 and node < n else {1}
            out += [Candidate(strategy="diloco", shard_size=s) for s in sorted(inner) if n // s > 1]
        else:
            out += [Candidate(strategy=name, shard_size=s) for s in sizes]
    if x.compress != "none":
        out += [
            Candidate(strategy=c.strategy, shard_size=c.shard_size, compress=x.compress)
            for c in out
            if c.strategy != "diloco" and n > 1  # 1-D sharded too: its reduce-scatter
        ]
    return out


def plan_row(c: Candidate, m: ModelShape, x: PlanInputs, hw: HardwareProfile) -> Row:
    f = footprint(c, m, x, hw)
    activations = m.activation_bytes * x.micro_batch
    if x.activation_checkpointing and m.layers:
        # Each block's input, plus one block's activations while it is recomputed.
        itemsize = 4 if x.param_bytes == 4 and not x.autocast else 2
        kept = m.layers * m.width * m.seq_len * itemsize * x.micro_batch
        activations = kept + activations / m.layers
    working = m.largest_activation * x.micro_batch
    transient = activations + working  # [Note: transient peak] in model.py, when traced
    if m.transient_bytes and not x.activation_checkpointing:
        transient = m.transient_bytes * x.micro_batch
    held = f.model_state + f.residuals + f.outer
    peak = held + f.gathered + max(transient, working + f.buckets - f.gathered)
    tokens = x.micro_batch * x.accumulation * m.seq_len
    flops = tokens * m.flops_per_token * (4 / 3 if x.activation_checkpointing else 1)
    forward_backward = flops / hw.rate_for(m.name)
    updated = m.params / (1 if c.strategy == "ddp" else c.shard_size)
    compute = forward_backward + updated / hw.optimizer_params_per_s
    by_window: dict[str, float] = {}
    for col in f.collectives:
        by_window[col.window] = by_window.get(col.window, 0.0) + col.seconds(hw)
    exposed = sum(
        t - min(t, hw.overlap * WINDOW_SHARE[w] * forward_backward)
        for w, t in by_window.items()
        if w != "steps"
    )
    for col in f.collectives:  # each behind its own inner steps, amortised like its time
        if col.window == "steps":
            t, hidden = col.seconds(hw), col.overlap_steps * forward_backward / col.every
            exposed += t - min(t, hw.overlap * hidden)
    step = compute + exposed
    return Row(
        candidate=c,
        memory=f,
        activations=activations,
        working=working,
        transient=transient,
        held_bytes=held,
        peak_bytes=peak,
        sent_bytes=sum(col.bytes_sent() for col in f.collectives),
        compute_s=compute,
        comm_s=sum(by_window.values()),
        exposed_s=exposed,
        step_s=step,
        tokens_per_s=tokens / step if step else 0.0,
        fits=peak <= hw.memory_bytes,
    )


def recommend(rows: list[Row], hw: HardwareProfile, lora: bool = False) -> tuple[Row | None, str]:
    """The fastest row that fits, with its reason in one line; or what is short by how much
    and what would shrink it (a LoRA fine-tune, when the plan is of a full one)."""
    fitting = [r for r in rows if r.fits]
    if not rows:
        return None, "no strategy to plan: DiLoCo needs at least two replicas"
    if not fitting:
        least = min(rows, key=lambda r: r.peak_bytes)
        short = least.peak_bytes - hw.memory_bytes
        return None, (
            f"no strategy fits in {hw.memory_bytes / 1e9:.3g} GB per rank: the smallest, "
            f"{least.candidate.label}, needs {least.peak_bytes / 1e9:.3g} GB, "
            f"{short / 1e9:.3g} GB short (activations {least.activations / 1e9:.3g} GB, model "
            f"states {least.memory.model_state / 1e9:.3g} GB); add ranks, lower --micro-batch"
            + (
                " or use --activation-checkpointing"
                if lora
                else ", use --activation-checkpointing or plan a LoRA fine-tune (--lora "
                "r=16,targets=q_proj,v_proj: the base frozen)"
            )
        )
    best = min(fitting, key=lambda r: r.step_s)
    others = sorted((r for r in fitting if r is not best), key=lambda r: r.step_s)
    margin = (
        f", {others[0].step_s / best.step_s - 1:.1%} ahead of {others[0].candidate.label}"
        if others
        else ""
    )
    return best, (
        f"{best.candidate.label}: the fastest that fits ({best.peak_bytes / 1e9:.3g} of "
        f"{hw.memory_bytes / 1e9:.3g} GB; step {best.step_s * 1e3:.4g} ms, "
        f"{best.exposed_s / best.step_s:.0%} exposed communication{margin})"
    )


def make_plan(model: ModelShape, hw: HardwareProfile, x: PlanInputs) -> Plan:
    rows = [plan_row(c, model, x, hw) for c in candidates(x, hw)]
    best, reason = recommend(rows, hw, lora=bool(model.frozen))
    return Plan(model, hw, x, rows, best, reason)

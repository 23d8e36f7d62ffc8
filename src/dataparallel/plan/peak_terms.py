"""The dry run's peak beside the plan's, term by term.

[Note: peak terms] The plan's peak (`plan_row`) is held + gathered + max(transient, working +
gradient buffers in flight): model states, ZeRO-3's gathered units, and the larger of the
activations and backward's temporaries at the traced peak ([Note: transient peak] in model.py)
and the widest tensor with the gradient buffers beyond the gathered ones (backward frees the
activations as the buffers fill). The dry run's peak is the most meta bytes alive at
once in the measured step ([Note: meta peak] in live_bytes.py); `label_held` and the phase tags
of `run_role` (dry_engine.py) say what each storage alive there is, and `peak_terms` maps the tags
onto the plan's terms:
- model states and gathered units: the model's parameters, the optimizer's (fp32 masters,
  ZeRO-3's shards), its gradients and state, and the engine's buffers made before the step
  (DDP's and ZeRO-1's flat gradient buckets, ZeRO-3's gathered units, the model's buffers);
- activations and temporaries: what forward, the loss and autograd's backward made and still
  alive at the peak (the plan: the traced transient peak);
- gradient buffers in flight: what the engine's hooks made in backward (ZeRO-2's buckets
  filling and reducing, ZeRO-3's full gradients of the units reducing);
- the rest (the optimizer step's temporaries): planned as none.
The plan's column sums to its peak and the engine's to the dry run's, so the gap is the sum of
the per-term gaps. docs/plan.md ("The dry run's peak, term by term") reads them on the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..strategies import ShardedGrad
from .live_bytes import LiveBytes

STATE = ("parameters", "masters or shards", "gradients", "optimizer state", "engine buffers")
TRANSIENT = ("forward", "forward (engine)", "loss", "loss (engine)", "backward")
IN_FLIGHT = ("backward (engine)",)


@dataclass(frozen=True)
class PeakTerm:
    """One term of the peak: bytes alive at the dry run's peak (`engine`) and in the plan's
    model (`plan`) ([Note: peak terms])."""

    name: str
    engine: int
    plan: int

    @property
    def gap(self) -> int:
        return self.engine - self.plan


def peak_terms(alive: dict[str, int], row) -> list[PeakTerm]:
    """The peak's terms from the tags alive at the dry run's peak (`RoleRun.peak_terms`) and
    the plan's `row`; their engine bytes sum to the dry run's peak, their plan bytes to
    `row.peak_bytes` ([Note: peak terms])."""
    f = row.memory

    def engine(tags) -> int:
        return sum(alive.get(t, 0) for t in tags)

    in_flight = max(0.0, row.working + f.buckets - f.gathered - row.transient)
    out = [
        PeakTerm(
            "model states and gathered units", engine(STATE), int(row.held_bytes + f.gathered)
        ),
        PeakTerm("activations and temporaries", engine(TRANSIENT), int(row.transient)),
        PeakTerm("gradient buffers in flight", engine(IN_FLIGHT), int(in_flight)),
    ]
    known = set(STATE + TRANSIENT + IN_FLIGHT)
    rest = sum(b for t, b in alive.items() if t not in known)
    out.append(PeakTerm("the rest (optimizer step)", rest, 0))
    return out


def label_held(live: LiveBytes, net, opt) -> None:
    """Tag what a step starts with ([Note: peak terms]): the model's parameters, the
    optimizer's own parameters (fp32 masters, ZeRO-3's shards) and state; the rest alive
    (ZeRO-3's gathered buffers, flat gradient buckets) is the engine's buffers."""
    live.tag_alive("engine buffers")
    model = {id(p) for p in net.parameters()}
    for p in net.parameters():
        live.label(p, "parameters")
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in model:
                live.label(p, "masters or shards")
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                live.label(value, "optimizer state")


def label_grads(live: LiveBytes, opt) -> None:
    """Tag the optimizer's gradients, made in backward, as gradients ([Note: peak terms])."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None and not isinstance(p.grad, ShardedGrad):
                live.label(p.grad, "gradients")

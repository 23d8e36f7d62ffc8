"""The dry run's peak beside the plan's, term by term.

[Note: peak terms] The plan's peak (`plan_row`) is held + gathered + working + max(activations,
gradient buffers in flight): model states, ZeRO-3's gathered units, the widest tensor backward
works on, and the larger of the activations and the gradient buffers beyond the gathered ones
(backward frees the one as the other fills). The dry run's peak is the most meta bytes alive at
once in the measured step ([Note: meta peak] in live_bytes.py); `label_held` and the phase tags
of `run_role` (dry_run.py) say what each storage alive there is, and `peak_terms` maps the tags
onto the plan's terms:
- model states and gathered units: the model's parameters, the optimizer's (fp32 masters,
  ZeRO-3's shards), its gradients and state, and the engine's buffers made before the step
  (DDP's and ZeRO-1's flat gradient buckets, ZeRO-3's gathered units, the model's buffers);
- activations: what forward and the loss made and still alive at the peak;
- backward's temporaries: what autograd made in backward and still alive (the plan: the widest
  tensor, one);
- gradient buffers in flight: what the engine's hooks made in backward (ZeRO-2's buckets
  filling and reducing, ZeRO-3's full gradients of the units reducing);
- the rest (the optimizer step's temporaries): planned as none.
The plan's column sums to its peak and the engine's to the dry run's, so the gap is the sum of
the per-term gaps. docs/plan.md ("The dry run's peak, term by term") reads them on the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

STATE = ("parameters", "masters or shards", "gradients", "optimizer state", "engine buffers")
ACTIVATIONS = ("forward", "forward (engine)", "loss", "loss (engine)")
TEMPORARIES = ("backward",)
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

    in_flight = max(0.0, f.buckets - f.gathered - row.activations)
    out = [
        PeakTerm(
            "model states and gathered units", engine(STATE), int(row.held_bytes + f.gathered)
        ),
        PeakTerm("activations", engine(ACTIVATIONS), int(row.activations)),
        PeakTerm("backward's temporaries", engine(TEMPORARIES), int(row.working)),
        PeakTerm("gradient buffers in flight", engine(IN_FLIGHT), int(in_flight)),
    ]
    known = set(STATE + ACTIVATIONS + TEMPORARIES + IN_FLIGHT)
    rest = sum(b for t, b in alive.items() if t not in known)
    out.append(PeakTerm("the rest (optimizer step)", rest, 0))
    return out

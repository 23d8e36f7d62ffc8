"""What the update of one element of a user's optimizer reads, which decides its layout.

[Note: optimizer layout] What the user's optimizer is built on under ZeRO-1/2/3 depends on one
question about its class: what may its update of one element read?
- "element": that element's gradient and state alone (and per-parameter scalars such as Adam's
  `step`): `ELEMENTWISE`, or a class declared with `dp.build_optimizer(..., elementwise=True)`.
  Flat shards: the optimizer steps 1-D pieces of the flat buffers ([Note: flat shard] in
  flat_shard.py), zero-copy bucket views balanced to the element; exactly the one-process
  update of those elements, each run stepped as one tensor ([Note: flat step] in flat_step.py).
- "parameter": its whole parameter (Adafactor's factored moments, Muon's orthogonalisation, a
  LAMB/LARS trust ratio, Shampoo, SOAP, 8-bit Adam's blocks): `WHOLE`, or `reads="parameter"`
  (`elementwise=False`). Each trainable parameter gets one owner in the shard group (largest
  first onto the least-loaded rank), which holds a whole master and its state, and the class
  runs unmodified on the owners' whole tensors ([Note: whole parameters] in owners.py).
- "group": every parameter of its param group (a step size estimated over the group), declared
  with `reads="group"`: each group has one owner, the groups balanced over the ranks.
- "all": every parameter the optimizer steps, across its groups (Prodigy's and D-Adaptation's
  step size d, sums over all the parameters; a global trust ratio): one owner for all of the
  class's groups. This is what a class dataparallel does not know gets (subclasses of torch's
  included: a subclass may change the update), because it is exact whatever the update reads;
  `build_optimizer` says so in one line (`unknown_notice`) with the declarations that spread
  it. Measured on today's engine before this layout: pytorch_optimizer's Prodigy on
  "parameter" owners estimated d = 3.07e-4 on one rank and 2.22e-4 on the other against
  2.45e-4 in one process, and ended 6.4e-4 off after 10 steps, silently.
Under "group" and "all" the owner's group dicts (where such classes keep their statistics,
Prodigy's `d`) are sent to the other ranks after each step, so a rank that reads
`optimizer.param_groups[0]["d"]`, and a checkpoint, see the one-process value on every rank.
DDP steps whole parameters on every rank whatever the class: only the flat step depends on it.
"""

from __future__ import annotations

import torch


class OptimizerLayoutWarning(UserWarning):
    """The one line `build_optimizer` says about a class it does not know."""


# torch.optim classes whose update is elementwise given per-parameter scalars: exact on flat
# shards (docs/zero.md's table checks each against the plain optimizer).
ELEMENTWISE = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.ASGD,
        torch.optim.Rprop,
        torch.optim.Adadelta,
    }
)
# torch.optim classes known to look at a whole parameter: `elementwise=True` is refused.
WHOLE = {
    torch.optim.Adafactor: "factors each matrix's second moment into rows and columns",
    torch.optim.Muon: "orthogonalises whole matrices",
}
# What the update of one element may read, narrowest first ([Note: optimizer layout]): its own
# element (flat shards), its whole parameter (balanced owners), its param group, or every
# parameter the optimizer steps (one owner for all of them).
READS = ("element", "parameter", "group", "all")


def layout_of(optimizer_cls: type, elementwise: bool | None, reads: str | None) -> tuple[str, bool]:
    """What `optimizer_cls`'s update of an element reads ([Note: optimizer layout]), and
    whether that is known (a torch class, or declared) rather than assumed.

    elementwise: the user's declaration (True: "element"; False: "parameter", its meaning
        before `reads`); reads: the user's declaration; both None: torch's classes by their
        kind, any other class (subclasses included) "all", the layout exact for every update.
    """
    if elementwise is not None and not isinstance(elementwise, bool):
        raise TypeError(f"build_optimizer: elementwise={elementwise!r} must be True, False or None")
    if reads is not None and reads not in READS:
        raise ValueError(
            f"build_optimizer: reads={reads!r} must be one of {', '.join(map(repr, READS))} "
            "(what the update of one element reads)"
        )
    if reads is not None and elementwise is not None:
        raise ValueError("build_optimizer: pass elementwise or reads, not both")
    declared = reads or {True: "element", False: "parameter", None: None}[elementwise]
    why = next((w for cls, w in WHOLE.items() if issubclass(optimizer_cls, cls)), None)
    if declared == "element" and why is not None:
        raise ValueError(
            f"build_optimizer: {optimizer_cls.__name__} {why}; it is not elementwise, drop "
            "elementwise=True (it gets whole parameters, exactly)"
        )
    if declared is not None:
        return declared, True
    if optimizer_cls in ELEMENTWISE:
        return "element", True
    if optimizer_cls in WHOLE:
        return "parameter", True
    return "all", False


def unknown_notice(optimizer_cls: type, strategy: str) -> str:
    """The one line `build_optimizer` says about a class it does not know."""
    return (
        f"build_optimizer: {optimizer_cls.__name__} is a class dataparallel does not know, so "
        f"under {strategy} one rank of each shard group steps all its parameters whole (exact "
        "whatever its update reads; that rank holds their state); declare what the update of "
        "one element reads to spread it: elementwise=True (flat shards), reads='parameter' "
        "(whole parameters on balanced owners) or reads='group'"
    )

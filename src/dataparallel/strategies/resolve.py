"""Where policies are resolved: a name or a policy in, the strategy that runs it out.

[Note: resolution] The choice between strategies is made here and nowhere else, above every
strategy module (no strategy imports another):
- a name ("ddp", "zero1", ...) means its policy with the defaults (`POLICIES`);
- DDP with a `param_dtype` narrower than the trained parameters (the first that takes a
  gradient: a frozen LoRA base does not decide) keeps fp32 masters and their optimizer
  state beside the low precision parameters: that is ZeRO-1 on shard groups of one rank (a
  2-D mesh with S = 1, [Note: mesh] in parts/mesh.py), all-reducing whole buckets across the
  replicas, so it is built as exactly that layout, and the layout names it "ddp"
  (`layout_name` in zero12/strategy.py): ZeRO-1 asked for on shard groups of one rank is the
  same strategy under the same name;
- every other policy builds its own strategy (`policy.apply`).
"""

from __future__ import annotations

from torch import nn

from .base import Strategy
from .ddp import DDP
from .parts.mesh import Groups, init_mesh
from .zero3 import ZeRO3
from .zero12 import ZeRO1, ZeRO2, ZeROStrategy

# Registry: strategy name -> policy class (called with no arguments for the defaults).
POLICIES: dict[str, type] = {"ddp": DDP, "zero1": ZeRO1, "zero2": ZeRO2, "zero3": ZeRO3}


def resolve_policy(strategy):
    """A policy object from a name ("ddp", ...) or a policy object (returned as is)."""
    if isinstance(strategy, str):
        if strategy not in POLICIES:
            known = ", ".join(sorted(POLICIES))
            raise ValueError(f"parallelize: unknown strategy {strategy!r}; choose one of {known}")
        return POLICIES[strategy]()
    if not hasattr(strategy, "apply"):
        raise TypeError(
            f"parallelize: strategy must be a name or a policy such as DDP(), got {strategy!r}"
        )
    return strategy


def apply_policy(policy, model: nn.Module, groups: Groups) -> Strategy:
    """The strategy that runs `policy` on `model` over `groups` ([Note: resolution])."""
    if isinstance(policy, DDP) and _needs_masters(policy, model):
        policy.check_groups(groups)
        mesh = init_mesh(1, groups.world.group)
        solo = Groups.build(None, mesh, groups.world.tracer, groups.world.pairwise)
        return ZeROStrategy(model, solo, ddp_with_masters(policy))
    return policy.apply(model, groups)


def _needs_masters(policy: DDP, model: nn.Module) -> bool:
    """Whether the trained parameters are wider than `param_dtype`, read from the first one
    that takes a gradient (a frozen one does not decide: a LoRA base loaded in bf16 comes first
    and is frozen; its fp32 adapters are what the policy's masters are for)."""
    first = next((p for p in model.parameters() if p.requires_grad), None)
    return first is not None and policy.precision.masters(first.dtype) is not None


def ddp_with_masters(policy: DDP) -> ZeRO1:
    """The ZeRO-1 policy that DDP with fp32 masters is ([Note: resolution])."""
    if policy.reduce_op != "mean":
        raise ValueError("DDP: reduce_op='sum' is not supported with a low param_dtype")
    return ZeRO1(
        bucket_mb=policy.bucket_mb,
        first_bucket_mb=policy.first_bucket_mb,
        precision=policy.precision,
        grad_reduce="all_reduce",
        comm_hook=policy.comm_hook,
        hook_state=policy.hook_state,
        broadcast_buffers=policy.broadcast_buffers,
    )

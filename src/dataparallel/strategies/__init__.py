"""Strategies: one module each, chosen by name or by a policy object."""

from .base import Strategy
from .ddp import DDP, DDPStrategy
from .fsdp import ZeRO3, ZeRO3Strategy
from .parts.geometry import SCALAR_STATE_KEYS, Geometry, HeldPiece, elementwise
from .parts.mesh import Groups, Mesh, init_mesh
from .parts.precision import MixedPrecision
from .zero import ZeRO1, ZeRO2, ZeROStrategy

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


__all__ = [
    "DDP",
    "DDPStrategy",
    "Geometry",
    "Groups",
    "HeldPiece",
    "Mesh",
    "MixedPrecision",
    "POLICIES",
    "SCALAR_STATE_KEYS",
    "Strategy",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "ZeRO3Strategy",
    "ZeROStrategy",
    "elementwise",
    "init_mesh",
    "resolve_policy",
]

"""Strategies: one module each, chosen by name or by a policy object."""

from .base import Strategy
from .ddp import DDP, DDPStrategy
from .fsdp import ZeRO3, ZeRO3Strategy
from .parts.geometry import SCALAR_STATE_KEYS, Geometry, HeldPiece, elementwise
from .parts.mesh import Groups, Mesh, as_mesh, init_mesh
from .parts.precision import MixedPrecision
from .resolve import POLICIES, apply_policy, resolve_policy
from .zero import ZeRO1, ZeRO2, ZeROStrategy

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
    "apply_policy",
    "as_mesh",
    "elementwise",
    "init_mesh",
    "resolve_policy",
]

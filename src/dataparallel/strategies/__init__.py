"""Strategies: one module each, chosen by name or by a policy object."""

from .base import Strategy
from .ddp import DDP, DDPStrategy
from .fsdp import ZeRO3, ZeRO3Strategy
from .parts.geometry import SCALAR_STATE_KEYS, Geometry, HeldPiece, elementwise
from .parts.mesh import Groups, Mesh, as_layout, init_mesh
from .parts.owners import ELEMENTWISE, whole_parameters
from .parts.precision import MixedPrecision
from .parts.tensor_parallel import (
    TensorParallel,
    bind_dtensor_views,
    check_apart,
    localize_parameters,
    tensor_parallel_of,
    whole_shape,
)
from .resolve import POLICIES, apply_policy, resolve_policy
from .zero import ZeRO1, ZeRO2, ZeROStrategy

__all__ = [
    "DDP",
    "DDPStrategy",
    "ELEMENTWISE",
    "Geometry",
    "Groups",
    "HeldPiece",
    "Mesh",
    "MixedPrecision",
    "POLICIES",
    "SCALAR_STATE_KEYS",
    "Strategy",
    "TensorParallel",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "ZeRO3Strategy",
    "ZeROStrategy",
    "apply_policy",
    "bind_dtensor_views",
    "check_apart",
    "as_layout",
    "elementwise",
    "init_mesh",
    "localize_parameters",
    "resolve_policy",
    "tensor_parallel_of",
    "whole_parameters",
    "whole_shape",
]

"""Strategies: one module each, chosen by name or by a policy object.

What this package exports is what the public API (api.py, compose.py, held.py) needs; the
job, checkpoints and inference use the public API, never these names or `parts/` directly.
"""

from .base import Strategy
from .ddp import DDP
from .parts.geometry import SCALAR_STATE_KEYS, Geometry, elementwise
from .parts.mesh import Groups, Mesh, as_layout, init_mesh
from .parts.optimizer_layout import ELEMENTWISE, READS, layout_of
from .parts.owners import assign_owners
from .parts.parallel_layout import Layout, LayoutError
from .parts.precision import PRECISIONS, MixedPrecision, Precision
from .parts.tensor_parallel import (
    bind_dtensor_views,
    check_apart,
    localize_parameters,
    tensor_parallel_of,
    whole_shape,
)
from .resolve import POLICIES, apply_policy, resolve_policy
from .zero3 import ZeRO3
from .zero12 import ZeRO1, ZeRO2

__all__ = [
    "DDP",
    "ELEMENTWISE",
    "READS",
    "Geometry",
    "Groups",
    "Layout",
    "LayoutError",
    "Mesh",
    "MixedPrecision",
    "POLICIES",
    "PRECISIONS",
    "Precision",
    "SCALAR_STATE_KEYS",
    "Strategy",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "apply_policy",
    "assign_owners",
    "bind_dtensor_views",
    "check_apart",
    "as_layout",
    "elementwise",
    "init_mesh",
    "layout_of",
    "localize_parameters",
    "resolve_policy",
    "tensor_parallel_of",
    "whole_shape",
]

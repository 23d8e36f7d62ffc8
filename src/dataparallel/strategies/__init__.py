"""Strategies: one module each, chosen by name or by a policy object.

What this package exports is what the public API (api.py, compose.py, held.py), the EMA,
activation checkpointing and the planner need: nothing outside strategies/ imports one of its
modules other than this face (tests/unit/test_layers.py). The job, checkpoints and inference use
the public API, never these names; features hold a parallelized model by its narrow `Handle`
([Note: the handle] in handle.py).
"""

from .base import Strategy, tensor_bytes
from .ddp import DDP
from .handle import Handle
from .model_copy import PlainCopy, next_hook_id
from .parts.flat_step import install_flat_step
from .parts.footprint import Footprint, ParamShapes, bucket_layouts, dtypes
from .parts.geometry import SCALAR_STATE_KEYS, Geometry, HeldPiece, elementwise
from .parts.geometry import full_state_dict as geometry_full_state_dict
from .parts.grouped import GROUP_CLASS_KEY, Grouped, split_classes
from .parts.layout import ShardLayout, padded_numel
from .parts.mesh import Groups, Mesh, as_layout, init_mesh
from .parts.optimizer_layout import (
    ELEMENTWISE,
    READS,
    OptimizerLayoutWarning,
    layout_of,
    unknown_notice,
)
from .parts.owners import assign_owners
from .parts.parallel_layout import Layout, LayoutError
from .parts.precision import PRECISIONS, MixedPrecision, Precision
from .parts.sharded_grads import ShardedGrad
from .parts.tensor_parallel import (
    bind_dtensor_views,
    check_apart,
    localize_parameters,
    tensor_parallel_of,
    to_local,
    whole_shape,
)
from .parts.torch_calls import is_carrier, load_local, local_state_dict
from .resolve import POLICIES, apply_policy, resolve_policy
from .zero3 import ZeRO3
from .zero3.plan import Wrap, param_shapes, select_units
from .zero12 import ZeRO1, ZeRO2

__all__ = [
    "DDP",
    "ELEMENTWISE",
    "Footprint",
    "GROUP_CLASS_KEY",
    "Grouped",
    "HeldPiece",
    "geometry_full_state_dict",
    "OptimizerLayoutWarning",
    "ParamShapes",
    "PlainCopy",
    "ShardLayout",
    "padded_numel",
    "ShardedGrad",
    "Wrap",
    "bucket_layouts",
    "dtypes",
    "install_flat_step",
    "is_carrier",
    "load_local",
    "local_state_dict",
    "next_hook_id",
    "param_shapes",
    "select_units",
    "split_classes",
    "tensor_bytes",
    "to_local",
    "unknown_notice",
    "READS",
    "Geometry",
    "Groups",
    "Handle",
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

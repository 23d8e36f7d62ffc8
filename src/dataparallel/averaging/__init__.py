"""Averagers for slow links: local SGD, DiLoCo and Streaming DiLoCo ([Note: averaging]).

streaming.py  Streaming DiLoCo's settings, their checks, the fragments' layout, the recipe
local_sgd.py  LocalSGD: the replicas' parameters averaged every few steps
diloco.py     DiLoCo: the outer step, streamed by fragments
"""

from .diloco import DiLoCo
from .local_sgd import LocalSGD, Reduced, flatten, held_tensors, unflatten
from .streaming import (
    OUTER_COMPRESS,
    OUTER_FORMATS,
    RECIPE,
    Streaming,
    check_streaming,
    short_run_recipe,
    split_fragments,
)

__all__ = [
    "OUTER_COMPRESS",
    "OUTER_FORMATS",
    "RECIPE",
    "DiLoCo",
    "LocalSGD",
    "Reduced",
    "Streaming",
    "check_streaming",
    "flatten",
    "held_tensors",
    "short_run_recipe",
    "split_fragments",
    "unflatten",
]

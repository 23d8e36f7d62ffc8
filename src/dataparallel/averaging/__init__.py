"""Averagers for slow links: local SGD, DiLoCo and Streaming DiLoCo ([Note: averaging]).

    streaming.py   Streaming DiLoCo's settings, their checks, the fragments' layout, the recipe
    outer_settings.py  the outer learning rate and momentum chosen for the run, measured
    flat.py        the held tensors as one flat vector, an async reduction of it
    schedule.py    FragmentSchedule: when each fragment has its outer step
    outer_wire.py  OuterWire: how outer gradients travel (fp32, bf16, int8/fp8/int4)
    outer_step.py  OuterStep: the anchors and the outer optimizer that moves them
    local_sgd.py   LocalSGD: the replicas' parameters averaged every few steps
    diloco.py      DiLoCo: the outer step every few steps, streamed by fragments

Each file imports only those above it; below the package: api.py, comm/, compression/.
"""

from .diloco import DiLoCo
from .flat import Reduced, flatten, unflatten
from .local_sgd import LocalSGD, held_tensors
from .outer_settings import CHOSEN, OuterSettings, choose_outer
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
    "CHOSEN",
    "OuterSettings",
    "choose_outer",
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

"""The planner: memory per rank, bytes sent and step time of every strategy, before launch
(docs/plan.md). `dataparallel.plan(...)` and `dataparallel plan`."""

from .api import plan
from .errors import PlanError
from .hardware import HardwareProfile, Link, load_profile
from .inputs import PlanInputs
from .model import ModelShape
from .ownership import MuonCompute, OptimizerMemory, Ownership, muon_compute, optimizer_memory
from .planner import Plan, Row
from .profiles import BUILTIN, get_profile

__all__ = [
    "BUILTIN",
    "HardwareProfile",
    "Link",
    "ModelShape",
    "MuonCompute",
    "OptimizerMemory",
    "Ownership",
    "Plan",
    "PlanError",
    "PlanInputs",
    "Row",
    "get_profile",
    "load_profile",
    "muon_compute",
    "optimizer_memory",
    "plan",
]

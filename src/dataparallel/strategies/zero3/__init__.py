"""ZeRO-3 (FSDP): parameters, gradients and optimizer state sharded, one flat unit at a time.

policy.py   `ZeRO3(...)`: what the policy takes, checks and builds
strategy.py the wiring: module and gradient hooks that call the units and the schedule
unit.py     `FlatUnit`: one unit's shard, gather, free, reduction, and its life cycle
schedule.py `Schedule`: prefetch, resharding, the reduction in flight
order.py    `UnitOrder`: every rank gathers the units in one order, checked then followed
plan.py     which modules become units (grouped, tied, frozen parameters)
group.py    `GroupedUnits`: the modules of a grouped unit run once each, in order

The contract is strategy.py's module docstring; docs/zero3.md has it in full.
"""

from .policy import ZeRO3

__all__ = ["ZeRO3"]

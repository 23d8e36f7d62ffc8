"""ZeRO-3's cross-unit schedule: which unit to gather ahead, and the one reduction in flight.

[Note: schedule] A unit gathers just before its forward and its backward; the schedule adds
what one unit cannot know:
- forward prefetch: at the k-th pre-forward of a step, the units that came (k+1)-th to
  (k+depth)-th in the previous step's forward start gathering too (depth: ZeRO3's `prefetch`,
  True is 1), so their all-gathers overlap this unit's compute;
- resharding after forward: a unit is freed after its forward, except the root (gathered for
  the whole step) and the unit that ran last in the previous step's forward (its backward comes
  first, so a free would be followed by an exposed gather at once);
- backward prefetch: the `depth` units whose backwards come next (the reverse of this step's
  post-forward order) start gathering when a unit's backward starts;
- one reduction in flight: a unit's reduction starts when its backward is over and the previous
  unit's is finished first (it had this unit's backward to run in); at the end of backward the
  units autograd did not call back for (the root, whose inputs are token ids) are reduced in
  backward order, then the rest;
- the order of the gathers, the same on every rank ([Note: same units on every rank] in
  order.py): checked unit by unit until it is steady, then followed by position.
"""

from __future__ import annotations

from ...comm import Comm
from .order import UnitOrder
from .unit import FlatUnit, ShardedState


class Schedule:
    """The order of one step across units ([Note: schedule]).

    units: the strategy's units, the root first.
    prefetch: how many units to gather ahead, in forward and in backward (True is 1).
    reshard_after_forward: free units after their forward (but the root and the last).
    check: the shard group the unit order is checked over ([Note: same units on every rank]).
    check_mode: "auto", "always" or "off" (ZeRO3's `check_order`).
    """

    def __init__(
        self,
        units: list[FlatUnit],
        prefetch: bool,
        reshard_after_forward: bool,
        check: Comm | None,
        check_mode: str,
    ):
        self.units = units
        self.depth = int(prefetch)
        self.reshard_after_forward = reshard_after_forward
        self.order = UnitOrder(check, check_mode, [u.name for u in units])
        self.calls: list[int] = []  # the positions of the unit forwards in progress (nested)
        self.forward_order: list[int] = []  # this step's pre-forward order
        self.previous_forward: list[int] = []  # the previous step's, for forward prefetch
        self.post_forward_order: list[int] = []
        self.backward_order: list[int] = []
        self.pending: FlatUnit | None = None  # the unit whose reduction is in flight

    def abandon(self) -> None:
        """After a round whose collectives failed: forget the step in progress (the units
        abandon theirs); the orders learned from earlier steps stay."""
        self.pending = None
        self.calls, self.forward_order, self.post_forward_order = [], [], []
        self.order.abandon()

    # -- forward ------------------------------------------------------------------------------
    def before_forward(self, unit: FlatUnit) -> bool:
        """Start the gathers of this call and the next; False when `unit` must not gather
        (this rank left the agreed order: [Note: same units on every rank])."""
        if unit.index == 0:
            self.order.settle()  # a forward with no backward since the last
            self.forward_order, self.post_forward_order, self.calls = [], [], []
            for u in self.units:  # left gathered by a forward with no backward: maybe stale
                u.free()
            self.order.begin()
        position = len(self.forward_order)
        self.calls.append(position)
        self.forward_order.append(unit.index)
        target = unit.index
        if unit.index != 0:
            prefetched = unit.sharded_state is not ShardedState.SHARDED
            target = self.order.at(position, unit.index, prefetched)
        self._gather_at(position, target)
        return target == unit.index

    def _gather_at(self, position: int, target: int | None) -> None:
        if target is not None:
            self.units[target].start_gather()  # then the next's, both under way while it waits
        for ahead in self.previous_forward[position + 1 : position + 1 + self.depth]:
            self.units[ahead].start_gather(prefetch=True)

    def after_forward(self, unit: FlatUnit, training: bool) -> bool:
        """Whether to free `unit` now that its forward is over."""
        position = self.calls.pop()
        self.post_forward_order.append(unit.index)
        if unit.index == 0:
            self._follow_to_end(training)
            self.order.end(self.forward_order)
            self.previous_forward = list(self.forward_order)
            self.backward_order = list(reversed(self.post_forward_order))
            if not training:  # no backward to hide the end check behind: verify it now, so
                self.order.settle()  # that no collective is left in flight when the caller
                for u in self.units:  # tears the group down ([Note: same units on every rank])
                    u.free()
            return False
        target = self.order.target(position, unit.index)
        if target is None:
            return False
        reshard = not training or (self.reshard_after_forward and not self._ran_last(target))
        if target != unit.index:  # the agreed unit's free, which every rank makes here
            if reshard:
                self.units[target].free()
            return False
        return reshard

    def _follow_to_end(self, training: bool) -> None:
        """A rank that ran fewer units than the agreed order still posts their gathers (and
        frees), so that every rank reaches the end-of-forward check."""
        agreed = self.order.agreed if self.order.steady else []
        for position in range(len(self.forward_order), len(agreed)):
            self._gather_at(position, agreed[position])
            last = self._ran_last(agreed[position])
            if not training or (self.reshard_after_forward and not last):
                self.units[agreed[position]].free()

    def _ran_last(self, index: int) -> bool:
        return bool(self.previous_forward) and self.previous_forward[-1] == index

    # -- backward -----------------------------------------------------------------------------
    def before_backward(self, unit: FlatUnit) -> None:
        self.order.settle()
        unit.start_gather()
        if self.depth and unit.index in self.backward_order:
            position = self.backward_order.index(unit.index)
            for ahead in self.backward_order[position + 1 : position + 1 + self.depth]:
                self.units[ahead].start_gather(prefetch=True)

    def reduce(self, unit: FlatUnit, hook, state) -> None:
        """Start `unit`'s reduction after finishing the one in flight."""
        if not unit.needs_reduce:
            return
        if self.pending is not None:
            self.pending.finish_reduce()
        unit.start_reduce(hook, state)
        self.pending = unit

    def reduce_rest(self, hook, state) -> None:
        """At the end of backward: every unit not reduced yet, then wait for all."""
        self.order.settle()
        order = self.backward_order + [
            u.index for u in reversed(self.units) if u.index not in self.backward_order
        ]
        for index in order:
            self.reduce(self.units[index], hook, state)
        if self.pending is not None:
            self.pending.finish_reduce()
            self.pending = None

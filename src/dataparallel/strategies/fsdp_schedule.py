"""ZeRO-3's cross-unit schedule: which unit to gather ahead, and the one reduction in flight.

[Note: schedule] A unit gathers just before its forward and its backward; the schedule adds
what one unit cannot know:
- forward prefetch: at the k-th pre-forward of a step, the unit that came (k+1)-th in the
  previous step's forward starts gathering too, so its all-gather overlaps this unit's compute;
- resharding after forward: a unit is freed after its forward, except the root (gathered for
  the whole step) and the unit that ran last in the previous step's forward (its backward comes
  first, so a free would be followed by an exposed gather at once);
- backward prefetch: the unit whose backward comes next (the reverse of this step's
  post-forward order) starts gathering when a unit's backward starts;
- one reduction in flight: a unit's reduction starts when its backward is over and the previous
  unit's is finished first (it had this unit's backward to run in); at the end of backward the
  units autograd did not call back for (the root, whose inputs are token ids) are reduced in
  backward order, then the rest.

[Note: same units on every rank] The collectives of a shard group pair by order, so every rank
must gather the same units in the same order. A unit that only some ranks run (an expert of a
mixture of experts wrapped on its own, a branch taken on some ranks) would pair one rank's
gather with another unit's on another rank: a hang, an abort, or, for units of one size, wrong
weights. So at each unit's forward, and at the end of the forward, the ranks of the shard group
all-gather which unit they are at (one integer each); if they differ, every rank raises the
same one-line error naming the units, before any mismatched gather is waited for:
- a rank that runs the unit the previous (checked) forward ran at this position, already
  prefetched, posts the check and verifies it at the next unit (lag one): its gathers follow
  an order every rank agreed on, so nothing it posts can pair wrongly, and the check's latency
  hides behind the unit's compute;
- any other rank (the first step, a changed order, prefetch off) verifies the check before it
  posts the unit's gather;
- every rank verifies the previous position's check before anything else, so a rank that went
  on while another stopped at a mismatch raises too, instead of waiting for a gather the other
  never posts.
`ZeRO3(check_order=False)` drops the check (measured in BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from ..comm import Comm
from .fsdp_unit import FlatUnit, ShardedState

END_OF_FORWARD = -1


class Schedule:
    """The order of one step across units ([Note: schedule]).

    units: the strategy's units, the root first.
    prefetch: gather the next unit ahead, in forward and in backward.
    reshard_after_forward: free units after their forward (but the root and the last).
    check: the shard group to agree on the unit order over ([Note: same units on every
        rank]); None skips the check.
    """

    def __init__(self, units: list[FlatUnit], prefetch: bool, reshard_after_forward: bool,
                 check: Comm | None):  # fmt: skip
        self.units = units
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.check = check if check is not None and check.world_size > 1 else None
        self.forward_order: list[int] = []  # this step's pre-forward order
        self.previous_forward: list[int] = []  # the previous step's, for forward prefetch
        self.post_forward_order: list[int] = []
        self.backward_order: list[int] = []
        self.pending: FlatUnit | None = None  # the unit whose reduction is in flight
        self._pending = None  # the unit-order check in flight: (work, everyone, mine, position)

    # -- forward ------------------------------------------------------------------------------
    def before_forward(self, unit: FlatUnit) -> None:
        """Start `unit`'s gather and the next one's; the root's forward starts a new step."""
        if unit.index == 0:
            self.forward_order, self.post_forward_order = [], []
            for u in self.units:  # left gathered by a forward with no backward: maybe stale
                u.free()
        position = len(self.forward_order)
        if unit.index != 0:
            self._verify()  # the previous position's check
            self._post_check(unit.index)
            agreed = position < len(self.previous_forward)
            agreed = agreed and self.previous_forward[position] == unit.index
            if not (agreed and unit.sharded_state is not ShardedState.SHARDED):
                self._verify()  # before posting a gather no rank may have agreed to
        self.forward_order.append(unit.index)
        unit.start_gather()  # then the next unit's, so both are under way while this one waits
        if self.prefetch and position + 1 < len(self.previous_forward):
            self.units[self.previous_forward[position + 1]].start_gather(prefetch=True)

    def after_forward(self, unit: FlatUnit, training: bool) -> bool:
        """Whether to free `unit` now that its forward is over."""
        self.post_forward_order.append(unit.index)
        if unit.index == 0:
            self._verify()
            self._post_check(END_OF_FORWARD)
            self._verify()
            self.previous_forward = list(self.forward_order)
            self.backward_order = list(reversed(self.post_forward_order))
            if not training:
                for u in self.units:
                    u.free()
            return False
        return not training or (self.reshard_after_forward and not self._ran_last(unit))

    def _ran_last(self, unit: FlatUnit) -> bool:
        return bool(self.previous_forward) and self.previous_forward[-1] == unit.index

    def _post_check(self, index: int) -> None:
        """Start the all-gather of which unit each rank is at ([Note: same units on every
        rank])."""
        if self.check is None:
            return
        mine = torch.tensor([index], dtype=torch.int64, device=self.check.device)
        everyone = torch.empty(self.check.world_size, dtype=torch.int64, device=mine.device)
        with self.check.tracer.labelled(what="unit order"):
            work = self.check.all_gather(everyone, mine, async_op=True)
        self._pending = (work, everyone, mine, len(self.forward_order))

    def _verify(self) -> None:
        """Wait for the check in flight, if any, and raise on every rank if ranks differ."""
        if self._pending is None:
            return
        work, everyone, _, position = self._pending
        self._pending = None
        work.wait()
        indices = everyone.tolist()
        if len(set(indices)) > 1:
            ran = ", ".join(f"rank {r}: {self._describe(i)}" for r, i in enumerate(indices))
            raise RuntimeError(
                f"ZeRO3: ranks ran different units at position {position} of this forward "
                f"({ran}); every rank must gather the same units in the same order: wrap the "
                "module that holds the optional ones (all experts of a mixture of experts, "
                "both sides of a branch) as one unit, e.g. ZeRO3(wrap=(MoELayer,))"
            )

    def _describe(self, index: int) -> str:
        return "the end of forward" if index == END_OF_FORWARD else f"'{self.units[index].name}'"

    # -- backward -----------------------------------------------------------------------------
    def before_backward(self, unit: FlatUnit) -> None:
        unit.start_gather()
        if self.prefetch and unit.index in self.backward_order:
            position = self.backward_order.index(unit.index)
            if position + 1 < len(self.backward_order):
                self.units[self.backward_order[position + 1]].start_gather(prefetch=True)

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
        order = self.backward_order + [
            u.index for u in reversed(self.units) if u.index not in self.backward_order
        ]
        for index in order:
            self.reduce(self.units[index], hook, state)
        if self.pending is not None:
            self.pending.finish_reduce()
            self.pending = None

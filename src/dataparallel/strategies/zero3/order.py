"""Every rank gathers ZeRO-3's units in one order: checked, then followed.

[Note: same units on every rank] The collectives of a shard group pair by order, so every rank
must gather the same units in the same order. A unit that only some ranks run (an expert of a
mixture of experts wrapped on its own, a branch taken on some ranks) would pair one rank's
gather with another unit's on another rank: a hang, an abort, or, for units of one size, wrong
weights. `UnitOrder` makes that an error, raised on every rank at once with one line that
names the units, in two modes:
- checking (the first steps, and every step under `check_order="always"`): at each unit's
  forward the ranks all-gather which unit they are at (one integer each). A rank that runs the
  unit the previous (checked) forward ran there, already prefetched, verifies that check at the
  next unit, so its latency hides behind the unit's compute; any other rank verifies it before
  it posts the unit's gather; every rank verifies the previous position's check first.
- steady (`"auto"`, once two checked forwards in a row ran the same order): no per-unit
  collective. Every rank posts the gathers and frees of the agreed order, position by
  position, whatever it runs; a rank that runs another unit (or more, or fewer) notes where,
  computes on parameters at rest (NaN) from there, still posts the agreed gathers to the end,
  and at the end of the forward one all-gather per step tells every rank: all raise, before
  any backward or step. That all-gather is started at the end of the forward and waited for
  before the first backward collective (or the next forward), so the loss computation hides
  its latency instead of a barrier exposing the ranks' skew; an eval forward (no backward)
  waits for it at its end, so that no collective is in flight when the caller ends the run.
  An order that changes the same way on every rank is then an error too;
  `check_order="always"` accepts it (and pays one small collective per unit).
Measured in BENCHMARKS.md.
"""

from __future__ import annotations

import torch

from ...comm import Comm

END_OF_FORWARD = -1
CHECK_MODES = ("auto", "always", "off")


class UnitOrder:
    """The order of unit forwards every rank follows ([Note: same units on every rank]).

    comm: the shard group (None, or a group of one: nothing to check).
    mode: "auto", "always" or "off".
    names: each unit's name, for the error.
    """

    def __init__(self, comm: Comm | None, mode: str, names: list[str]):
        self.comm = comm if mode != "off" and comm is not None and comm.world_size > 1 else None
        self.always = mode == "always"
        self.names = names
        self.agreed: list[int] = []  # the order the last checked forward ran, on every rank
        self.steady = False
        self.deviation: tuple[int, int] | None = None  # (position, unit) this rank left it at
        self._pending = None  # a check in flight: (work, everyone, position)
        self._steady_end = None  # a steady forward's end check in flight: (work, everyone)

    def begin(self) -> None:
        self.deviation = None

    def at(self, position: int, index: int, prefetched: bool) -> int | None:
        """Before the forward of unit `index` at `position`: the unit whose gather this
        position posts (None: none), after the check a checking forward makes there."""
        if self.comm is None or self.steady:
            return self.target(position, index)
        self._verify()  # the previous position's
        self._post(index, position)
        agreed = position < len(self.agreed) and self.agreed[position] == index
        if not (agreed and prefetched):
            self._verify()  # before posting a gather no rank may have agreed to
        return index

    def target(self, position: int, index: int) -> int | None:
        """The unit the schedule gathers and frees for the call at `position` (steady: the
        agreed one, noting a deviation)."""
        if self.comm is None or not self.steady:
            return index
        expected = self.agreed[position] if position < len(self.agreed) else None
        if expected != index and self.deviation is None:
            self.deviation = (position, index)
        return expected

    def end(self, order: list[int]) -> None:
        """At the end of the forward: the check that every rank ran `order` alike (steady:
        started here, verified by `settle` before the next collective of the shard group)."""
        if self.comm is None:
            return
        if self.steady:
            if self.deviation is None and len(order) < len(self.agreed):
                self.deviation = (len(order), END_OF_FORWARD)  # it ran fewer units
            position, index = self.deviation or (-1, -1)
            self._steady_end = self._gather([position, index])
            return
        self._verify()
        self._post(END_OF_FORWARD, len(order))
        self._verify()
        self.steady = not self.always and order == self.agreed
        self.agreed = list(order)

    # -- the collectives ----------------------------------------------------------------------
    def _gather(self, values: list[int]):
        mine = torch.tensor(values, dtype=torch.int64, device=self.comm.device)
        everyone = torch.empty(len(values) * self.comm.world_size, dtype=torch.int64)
        everyone = everyone.to(mine.device)
        with self.comm.tracer.labelled(what="unit order"):
            work = self.comm.all_gather(everyone, mine, async_op=True)
        return work, everyone

    def _post(self, index: int, position: int) -> None:
        work, everyone = self._gather([index])
        self._pending = (work, everyone, position)

    def _verify(self) -> None:
        if self._pending is None:
            return
        work, everyone, position = self._pending
        self._pending = None
        work.wait()
        ran = everyone.tolist()
        if len(set(ran)) > 1:
            self._raise(position, ran)

    def abandon(self) -> None:
        """Drop a check in flight on a group whose collectives failed (live recovery)."""
        self._steady_end = None

    def settle(self) -> None:
        """Verify the steady end-of-forward check, if one is in flight: before backward (a rank
        off the order would post other units' collectives there) or the next forward."""
        if self._steady_end is None:
            return
        work, everyone = self._steady_end
        self._steady_end = None
        work.wait()
        pairs = everyone.view(-1, 2).tolist()
        first = min((p for p, _ in pairs if p >= 0), default=None)
        if first is None:
            return
        expected = self.agreed[first] if first < len(self.agreed) else END_OF_FORWARD
        self._raise(first, [i if p == first else expected for p, i in pairs])

    def _raise(self, position: int, ran: list[int]) -> None:
        described = ", ".join(f"rank {r}: {self._describe(i)}" for r, i in enumerate(ran))
        raise RuntimeError(
            f"ZeRO3: ranks ran different units at position {position} of this forward "
            f"({described}); every rank must gather the same units in the same order: wrap the "
            "module that holds the optional ones (all experts of a mixture of experts, both "
            "sides of a branch) as one unit, e.g. ZeRO3(wrap=(MoELayer,)); if the order changes "
            "alike on every rank, pass ZeRO3(check_order='always')"
        )

    def _describe(self, index: int) -> str:
        return "the end of forward" if index == END_OF_FORWARD else f"'{self.names[index]}'"

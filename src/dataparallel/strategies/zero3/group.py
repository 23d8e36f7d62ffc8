"""The modules of a grouped ZeRO-3 unit, run once each and in order ([Note: grouped units] in
plan.py).

[Note: members in order] A grouped unit's hooks sit on every one of its modules, but only the
first module's pre-forward opens the unit (gathers it, wraps its inputs for the post-backward)
and only the last module's post-forward closes it (frees it, hooks its outputs for the
pre-backward). A forward that skipped or reordered a module would leave the unit open, with no
pre-backward to gather it again for its gradients, or compute a module before its parameters
were gathered (on NaN, [Note: parameters at rest] in unit.py). `MemberRun` refuses both
with one error on the rank that does it: a module that is not the next one to run, a unit that
opens while an earlier group is still open (not around it), and a forward that ends with a
group open. The recomputed forward of activation checkpointing ([Note: recomputed forward] in
unit.py) runs in backward, in any order, and is not counted.
"""

from __future__ import annotations


class MemberRun:
    """Which module of one grouped unit runs next.

    unit: the unit's name ("blocks.0-3").
    members: its modules' names, in the order they must run.
    index: the unit's position in the plan (the one units nested in it name as their parent).
    """

    def __init__(self, unit: str, members: tuple[str, ...], index: int):
        self.unit, self.members, self.index = unit, members, index
        self.next = 0  # the member whose forward comes next; 0: the unit is closed

    @property
    def open(self) -> bool:
        return self.next != 0

    def enter(self, member: int) -> bool:
        """Before member `member`'s forward: True when it opens the unit."""
        if member != self.next:
            expected = self.members[self.next]
            raise RuntimeError(
                f"ZeRO3: module '{self.members[member]}' ran where '{expected}' was due, in "
                f"unit '{self.unit}', which groups {list(self.members)}: each module of a "
                "grouped unit must run once per forward, in order; pass "
                "ZeRO3(min_unit_params=0) to make each module its own unit"
            )
        return member == 0

    def leave(self, member: int) -> bool:
        """After member `member`'s forward: True when it closes the unit."""
        self.next = 0 if member == len(self.members) - 1 else member + 1
        return self.next == 0

    def reset(self) -> None:
        """A new forward of the model (a forward that raised left the unit open)."""
        self.next = 0

    def refuse_open(self, at: str) -> None:
        """This unit is open where it cannot be (`at`: what is happening there)."""
        raise RuntimeError(
            f"ZeRO3: unit '{self.unit}', which groups {list(self.members)}, ran "
            f"'{self.members[self.next - 1]}' but not '{self.members[self.next]}' before {at}: "
            "each module of a grouped unit must run once per forward, in order; pass "
            "ZeRO3(min_unit_params=0) to make each module its own unit"
        )


class GroupedUnits:
    """The grouped units of a model, and which of them are open ([Note: members in order]).

    parents: each unit's enclosing unit in the plan (None for the root).
    """

    def __init__(self, parents: list[int | None]):
        self.parents = parents
        self.runs: list[MemberRun] = []
        self.open: list[MemberRun] = []  # in the order they opened

    def add(self, unit: str, members: tuple[str, ...], index: int) -> MemberRun:
        run = MemberRun(unit, members, index)
        self.runs.append(run)
        return run

    def opening(self, index: int, name: str) -> None:
        """Unit `index` opens: every open group must enclose it (the root starts anew)."""
        if index == 0:
            for run in self.runs:
                run.reset()
            self.open = []
        for run in self.open:
            parent = self.parents[index]
            while parent is not None and parent != run.index:
                parent = self.parents[parent]
            if parent is None:
                run.refuse_open(f"unit '{name}' started")

    def ending(self) -> None:
        """The root's forward is over: no group may be open."""
        if self.open:
            self.open[-1].refuse_open("the end of the forward")

"""Who trains in the next generation of a live run: the quorum's rule, as pure functions.

    report = Report(replica=2, step=40, where=STEP)     # what a replica says when it regroups
    membership = decide(previous, reports, alive, waited_s, QuorumPolicy(join_timeout_s=30))

[Note: membership] A live run (`dataparallel train --recovery live`, train/recovery.py) is a
sequence of *generations*. Each one is a `Membership`: the replicas that train together, in
rank order, and the step they all stand at. A replica is a failure domain (one rank under DDP)
named by its slot, 0..N-1; a replacement started for a lost replica takes its slot. When a
collective fails (a peer died, or stalled past the collective timeout) or a replacement waits
to join, the replicas *report* for the next generation: their slot, the number of optimizer
steps they have applied, and where they stand (`STEP`: at or inside a training step, which is
redone; `EVAL`: inside an evaluation, which is redone; `JOIN`: a replacement). One decider
(the launcher, train/live_launch.py) applies `decide` to what it has read and publishes the
result; nobody else decides, so nobody can disagree.

The rule:
- Expected: the members of the last generation whose process is still alive (the launcher
  does not count a replacement as a member before it is let in), and whoever reported.
  The decision waits until all of them have reported, or until `join_timeout_s` has passed
  since the first report; then the silent ones are left out (stalled: the launcher kills them).
  A peer stuck in a collective notices within the collective timeout, so the timeout to give
  is a little more than that.
- Replacements (`JOIN`) are let in only when no member reports from inside an evaluation:
  a replacement enters the training loop at a step, and everyone must do the same next thing.
- The members are the reporters in slot order; ranks are their positions. Everyone stands at
  the largest step reported; the *source* is the lowest slot of the last generation at that
  step, and every member below it, or new, is *healed*: it receives the source's parameters,
  optimizer state and data position over the network (train/recovery.py).
No update is ever applied from a partial batch: a step whose collectives failed is rewound
before its replica reports, so the step reported is the last one every member's update has in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

STEP = "step"  # at or inside a training step: it is redone with the whole global batch
EVAL = "eval"  # inside an evaluation: it is redone
JOIN = "join"  # a replacement, built and waiting to be healed
PLACES = (STEP, EVAL, JOIN)


class QuorumError(RuntimeError):
    """No generation can be formed (nobody reported before the timeout)."""


@dataclass(frozen=True, kw_only=True)
class Report:
    """What a replica says when it asks to be in generation `generation`.

    replica: its slot, 0..N-1 (a replacement takes the slot of the replica it replaces).
    step: optimizer steps it has applied (a replacement: 0; it is healed anyway).
    where: STEP, EVAL or JOIN ([Note: membership]).
    pid: its process id, for the launcher's messages.
    """

    replica: int
    step: int
    where: str = STEP
    pid: int = 0

    def __post_init__(self):
        if self.where not in PLACES:
            raise ValueError(f"Report: where={self.where!r} must be one of {PLACES}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Report:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True)
class Membership:
    """One generation of a live run ([Note: membership]).

    generation: its number, 0 for the workers started together.
    members: the replicas' slots in rank order (rank r is members[r]).
    step: the step every member stands at once healed.
    source: the slot whose state the healed members receive (a member at `step`).
    healed: the slots that receive it (behind `step`, or new); empty: nobody moves.
    """

    generation: int
    members: tuple[int, ...]
    step: int = 0
    source: int = 0
    healed: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, replica: int) -> int:
        """The rank of slot `replica` in this generation (ValueError if it is not a member)."""
        return self.members.index(replica)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Membership:
        data = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def first_membership(replicas: int) -> Membership:
    """The generation before the first: the `replicas` workers started together, at step 0
    (generation -1, so that the first decided one is 0)."""
    return Membership(generation=-1, members=tuple(range(replicas)))


@dataclass(frozen=True, kw_only=True)
class QuorumPolicy:
    """How long the decider waits for the members it expects.

    join_timeout_s: seconds after the first report of a generation before the members of the
        last generation that have not reported are left out (and killed as stalled). Give it
        more than the collective timeout: a member blocked on a collective with a stalled (or
        another blocked) peer reports once that collective times out.
    """

    join_timeout_s: float = 300.0


def decide(
    previous: Membership,
    reports: dict[int, Report],
    alive: set[int],
    waited_s: float,
    policy: QuorumPolicy = QuorumPolicy(),
) -> Membership | None:
    """The next generation after `previous` from the `reports` read so far (by slot), or None
    while the decider should wait ([Note: membership]).

    alive: the slots whose process is alive (the launcher sees its children).
    waited_s: seconds since the first of these reports was seen.
    Raises QuorumError when the timeout passed and no member of `previous` reported.
    """
    if not reports:
        return None
    expected = {r for r in previous.members if r in alive} | set(reports)
    if not expected <= set(reports) and waited_s < policy.join_timeout_s:
        return None
    # A replacement takes a lost replica's slot: it is new by what it says, not by its slot.
    old = [r for r in sorted(reports) if r in previous.members and reports[r].where != JOIN]
    new = [r for r in sorted(reports) if r not in old]
    if not old:
        if waited_s < policy.join_timeout_s:
            return None  # replacements alone: wait for the members
        raise QuorumError(
            f"no replica of generation {previous.generation} reported within "
            f"{policy.join_timeout_s:g} s; nothing is left to heal from"
        )
    if any(reports[r].where == EVAL for r in old):
        new = []  # a replacement enters at a step; it waits for the next generation
    step = max(reports[r].step for r in old)
    behind = [r for r in old if reports[r].step < step]
    return Membership(
        generation=previous.generation + 1,
        members=tuple(sorted(old + new)),
        step=step,
        source=min(r for r in old if reports[r].step == step),
        healed=tuple(sorted(behind + new)),
    )


def waiting_to_join(reports: dict[int, Report]) -> list[int]:
    """The replacements among the reports for the next generation: the members should regroup
    at their next step boundary to let them in."""
    return sorted(r for r, report in reports.items() if report.where == JOIN)


def left_out(previous: Membership, decided: Membership) -> list[int]:
    """Members of `previous` not in `decided` (dead or stalled; the launcher kills the latter)."""
    return [r for r in previous.members if r not in decided.members]

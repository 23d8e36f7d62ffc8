"""Who trains in the next generation of a live run: the quorum's rule, as pure functions.

    report = Report(replica=2, step=40, where=STEP)     # what a replica says when it regroups
    membership = decide(previous, reports, alive, waited_s, QuorumPolicy(join_timeout_s=30))
    refuse_join(size=3, policy=QuorumPolicy(max_replicas=3))    # "the run has 3 replica(s), ..."

[Note: membership] A live run (`dataparallel train --recovery live`, recovery.py) is a
sequence of *generations*. Each one is a `Membership`: the replicas that train together, in
rank order, and the step they all stand at. A replica is a failure domain (one rank under DDP,
the S ranks of an HSDP replica) named by its slot: 0..N-1 for the workers started together; a
replacement started for a lost replica takes its slot, and a replica that joins the run from
outside (`dataparallel join`) gets a fresh one, N and up. When a collective fails (a peer died, or stalled past the
collective timeout), a replacement or a joiner waits to join, or a member was asked to leave
(`dataparallel leave`), the replicas *report* for the next generation: their slot, the number
of optimizer steps they have applied, and where they stand (`STEP`: at or inside a training
step, which is redone; `EVAL`: inside an evaluation, which is redone; `JOIN`: a replacement or
a joiner; `LEAVE`: a member leaving). One decider (the launcher, launcher.py) applies
`decide` to what it has read and publishes the result; nobody else decides, so nobody can
disagree.

The rule:
- Expected: the members of the last generation whose process is still alive (the launcher
  does not count a replacement as a member before it is let in), and whoever reported.
  The decision waits until all of them have reported, or until `join_timeout_s` has passed
  since the first report; then the silent ones are left out (stalled: the launcher kills them).
  A peer stuck in a collective notices within the collective timeout, so the timeout to give
  is a little more than that.
- Replacements and joiners (`JOIN`) are let in only when no member reports from inside an
  evaluation (a replica enters the training loop at a step, and everyone must do the same next
  thing), never into generation 0 (the workers started together meet there without a heal),
  and only up to `max_replicas`, lowest slots first (replacements before joiners).
- Leavers (`LEAVE`) are not in it; they were members, so nothing is rewound or healed for them.
- The members are the other reporters in slot order; ranks are their positions. Everyone stands
  at the largest step a staying member reported; the *source* is the lowest slot of the last
  generation at that step, and every member below it, or new, is *healed*: it receives the
  source's parameters, optimizer state and data position over the network (recovery.py).
- No member of the last generation reported, only replacements: the decider waits for the
  members still alive up to `join_timeout_s`; with none alive (every replica holding the run's
  state was lost, say a healed replica's source died during the heal) the run stops at once,
  to be resumed from its last checkpoint (`QuorumError`).
- Fewer than `min_replicas` members: no generation. While replicas are on their way (a
  replacement starting, a joiner let in at the door) the decider waits for them up to
  `join_timeout_s`; then, or at once when none is coming or none could enter (evaluating, or
  generation 0), `BelowMinimum`: the run stops, to be resumed from its last checkpoint.
Sizes are also kept at the door ([Note: membership requests] in requests.py): a joiner is
refused when the run counts `max_replicas` already (`refuse_join`), a leave when fewer than
`min_replicas` members would stay (`refuse_leave`).
No update is ever applied from a partial batch: a step whose collectives failed is rewound
before its replica reports, so the step reported is the last one every member's update has in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property

STEP = "step"  # at or inside a training step: it is redone with the whole global batch
EVAL = "eval"  # inside an evaluation: it is redone
JOIN = "join"  # a replacement or a joiner, built and waiting to be healed
LEAVE = "leave"  # a member asked to leave: not in the next generation, and not replaced
PLACES = (STEP, EVAL, JOIN, LEAVE)


class QuorumError(RuntimeError):
    """No generation can be formed (nobody reported before the timeout)."""


class BelowMinimum(QuorumError):
    """The next generation would have fewer than `QuorumPolicy.min_replicas` members."""


@dataclass(frozen=True, kw_only=True)
class Report:
    """What a replica says when it asks to be in generation `generation`.

    replica: its slot (a replacement takes the slot of the replica it replaces, a joiner a new
        one).
    step: optimizer steps it has applied (a replacement or joiner: 0; it is healed anyway).
    where: STEP, EVAL, JOIN or LEAVE ([Note: membership]).
    pid: its process id, for the launcher's messages.
    timed_out: its collective failed by waiting the whole collective timeout (a peer stalled),
        not at once (a peer's connection closed): see `QuorumPolicy.grace_s`.
    """

    replica: int
    step: int
    where: str = STEP
    pid: int = 0
    timed_out: bool = False

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

    @cached_property
    def slots(self) -> frozenset[int]:
        """The members as a set: `slot in membership.slots` costs the same at any size (a test
        per report against the tuple made a decision at 10,000 replicas quadratic)."""
        return frozenset(self.members)

    def rank_of(self, slot: int) -> int:
        """The rank of `slot` in this generation (ValueError if it is not a member)."""
        return self.members.index(slot)

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
    """How long the decider waits for the members it expects, and the sizes a generation may have.

    join_timeout_s: seconds after the first report of a generation before the members of the
        last generation that have not reported are left out (and killed as stalled). Give it
        more than the collective timeout: a member blocked on a collective with a stalled (or
        another blocked) peer reports once that collective times out. Also how long a
        generation short of `min_replicas` waits for replicas on their way.
    min_replicas: the fewest members a generation may have (--min-replicas).
    max_replicas: the most (--max-replicas); 0: no bound.
    grace_s: seconds after the first report of a timed-out collective before the silent
        members are left out. Such a report says a peer stalled; the members' collectives of
        that step began within a step of each other, so every healthy member's has failed or
        timed out by then too, and one still silent is the stalled one (dropped at the
        collective timeout + grace_s, not + join_timeout_s). A kill is seen at once by some
        members and only at their timeout by others blocked on them, so a report of a closed
        connection does not shorten the wait.
    """

    join_timeout_s: float = 300.0
    min_replicas: int = 1
    max_replicas: int = 0
    grace_s: float = 10.0

    def __post_init__(self):
        if self.min_replicas < 1:
            raise ValueError(f"QuorumPolicy: min_replicas={self.min_replicas} must be >= 1")
        if self.max_replicas and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"QuorumPolicy: max_replicas={self.max_replicas} must be 0 (no bound) or >= "
                f"min_replicas={self.min_replicas}"
            )

    def room(self, members: int) -> int:
        """How many more replicas a run of `members` may take (a large number: no bound)."""
        return max(0, self.max_replicas - members) if self.max_replicas else 1 << 30


def decide(
    previous: Membership,
    reports: dict[int, Report],
    alive: set[int],
    waited_s: float,
    policy: QuorumPolicy = QuorumPolicy(),
    arriving: int = 0,
    timed_out_s: float | None = None,
) -> Membership | None:
    """The next generation after `previous` from the `reports` read so far (by slot), or None
    while the decider should wait ([Note: membership]).

    alive: the slots whose process is alive (the launcher sees its children, and the heartbeat
        of a joiner it did not start).
    waited_s: seconds since the first of these reports was seen.
    arriving: replicas on their way that have not reported (replacements starting, joiners let
        in at the door): what a generation short of `policy.min_replicas` waits for.
    timed_out_s: seconds since the first report with `timed_out` was seen (None: none yet).
    Raises QuorumError when the timeout passed and no member of `previous` reported, and
    BelowMinimum when the generation would stay short of `policy.min_replicas`.
    """
    if not reports:
        return None
    expected = {r for r in previous.members if r in alive} | set(reports)
    all_in = expected <= set(reports)  # every live replica it waits for has reported
    members = previous.slots
    stalled = timed_out_s is not None and timed_out_s >= policy.grace_s
    if not all_in and waited_s < policy.join_timeout_s and not stalled:
        return None
    # A replacement takes a lost replica's slot: it is new by what it says, not by its slot.
    staying = (STEP, EVAL)
    slots = sorted(reports)
    old = [r for r in slots if r in members and reports[r].where in staying]
    new = [r for r in slots if reports[r].where == JOIN]
    if not old:
        if all_in:  # every live replica is new: nobody holds the state
            raise QuorumError(
                f"every replica of generation {previous.generation} was lost (members "
                f"{list(previous.members)}); nothing is left to heal from"
            )
        if waited_s < policy.join_timeout_s:
            return None  # replacements alone: wait for the members still alive
        raise QuorumError(
            f"no replica of generation {previous.generation} reported within "
            f"{policy.join_timeout_s:g} s; nothing is left to heal from"
        )
    # A replica enters at a step, healed; else it waits for the next generation.
    may_enter = previous.generation >= 0 and not any(reports[r].where == EVAL for r in old)
    new = new[: policy.room(len(old))] if may_enter else []  # lowest slots (replacements) first
    if len(old) + len(new) < policy.min_replicas:
        if arriving and may_enter and waited_s < policy.join_timeout_s:
            return None  # a replacement or a joiner may bring the run back to its minimum
        raise BelowMinimum(
            f"generation {previous.generation + 1} would have {len(old) + len(new)} "
            f"replica(s), fewer than --min-replicas {policy.min_replicas}"
        )
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
    """The replacements and joiners among the reports for the next generation: the members
    should regroup at their next step boundary to let them in."""
    return sorted(r for r, report in reports.items() if report.where == JOIN)


def gone(previous: Membership, decided: Membership) -> list[int]:
    """Members of `previous` not in `decided`: dead, dropped (stalled: the launcher kills them)
    or released."""
    return [r for r in previous.members if r not in decided.slots]


def refuse_join(size: int, policy: QuorumPolicy) -> str | None:
    """Why one more replica may not join a run that counts `size` replicas (members, and
    replicas on their way), or None: it may."""
    if policy.room(size) > 0:
        return None
    return (
        f"the run has {size} replica(s), its maximum (--max-replicas {policy.max_replicas}); "
        "start it with a larger --max-replicas, or wait for one to leave"
    )


def refuse_leave(replica: int, members: list[int], policy: QuorumPolicy) -> str | None:
    """Why `replica` may not leave the run whose members (training, and not leaving already)
    are `members`, or None: it may."""
    if replica not in members:
        return f"replica {replica} is not a member of the run (its members: {sorted(members)})"
    if len(members) - 1 < policy.min_replicas:
        return (
            f"{len(members) - 1} replica(s) would stay, fewer than --min-replicas "
            f"{policy.min_replicas}; add one first (dataparallel join RUN_DIR)"
        )
    return None

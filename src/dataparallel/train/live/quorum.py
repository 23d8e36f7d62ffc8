"""The quorum of a live run in the launcher's store: reports in, one decision out.

    quorum = Quorum(store, slot=1)                      # a worker
    quorum.report(generation, Report(replica=1, step=40))
    membership = quorum.wait(generation, timeout_s)     # published by the launcher

    host = QuorumHost(store, slots=3)                   # the launcher
    reports = host.reports(generation)
    host.publish(membership)

[Note: quorum keys] Under the store's prefix (the keys are named in store.py), generation g has
    gen/g/report/<slot>   a Report (JSON), written by the replica that asks to be in g (or to
                          be healed: JOIN), sealed with the run's key for this key only
                          ([Note: signed requests] in secret.py): one that does not verify
                          is left out, and said once in the launcher's log;
    gen/g/decision        the Membership (JSON), written once, by the launcher;
    gen/g/regroup         set by the launcher when a replacement waits: the members of g
                          regroup at their next step boundary to let it in;
    gen/g/arrived/<rank>  set by each rank of g before it forms g's group: it forms the group
                          only once every rank has arrived, within the collective timeout
                          (gloo waits for a rank that never comes for good);
    gen/g/pg/...          the keys of generation g's process group (runtime.regroup).
and `latest` holds the last decided generation's number (where a replacement reports next).
A joiner or a leaver asks through keys of its own ([Note: membership requests] in requests.py);
`leave/<slot>` is where a member learns that it is released.
A decision is never rewritten, so a late reader sees what was decided; a report may be (a
replacement reports in its lost predecessor's slot), and the launcher counts a report only
from the process now in its slot.
The rule that turns reports into a decision is pure ([Note: membership] in membership.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from .membership import Membership, Report
from .secret import Refused, RunKey
from .store import LATEST, arrived_key, decision_key, leave_key, regroup_key, report_key


class Quorum:
    """A worker's side of the quorum ([Note: quorum keys]).

    store: the launcher's store (under the run's prefix).
    slot: the slot of this worker's replica.
    poll_s: how often a wait looks at the store.
    key: the run's key, which seals its reports (None: unsealed, the quorum's unit tests).
    """

    def __init__(
        self, store: dist.Store, slot: int, poll_s: float = 0.01, key: RunKey | None = None
    ):
        self.store, self.slot, self.poll_s, self.key = store, slot, poll_s, key

    def latest(self) -> int:
        """The last decided generation (-1 before the first)."""
        if not self.store.check([LATEST]):
            return -1
        return int(self.store.get(LATEST))

    def report(self, generation: int, report: Report) -> None:
        key, text = report_key(generation, self.slot), report.to_json()
        self.store.set(key, self.key.seal(text, purpose=key) if self.key is not None else text)

    def wait(self, generation: int, timeout_s: float) -> Membership:
        """The decision for `generation`, once published (TimeoutError after `timeout_s`)."""
        key, deadline = decision_key(generation), time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no decision for generation {generation} within {timeout_s:g} s"
                )
            time.sleep(self.poll_s)
        return Membership.from_json(self.store.get(key))

    def arrive(self, generation: int, rank: int, size: int, timeout_s: float) -> bool:
        """Say that `rank` is here to form generation `generation`'s group of `size` ranks,
        and wait for the others: False when one of them has not come within `timeout_s` (it
        was lost after the decision: a joiner's death is known only from its heartbeat)."""
        self.store.set(arrived_key(generation, rank), "1")
        keys, deadline = [arrived_key(generation, r) for r in range(size)], time.monotonic()
        deadline += timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)
        return True

    def regroup_asked(self, generation: int) -> bool:
        """Whether the launcher asked the members of `generation` to regroup (a replacement
        waits to join)."""
        return self.store.check([regroup_key(generation)])

    def released(self) -> bool:
        """Whether the launcher released this replica (`dataparallel leave`): it reports LEAVE
        at its next regroup."""
        return self.store.check([leave_key(self.slot)])


class QuorumHost:
    """The launcher's side: reads the reports of a generation, publishes its decision.

    store: the store the launcher hosts (under the run's prefix).
    slots: how many replica slots the run has: the workers started together, and the joiners
        given the next slots (the launcher counts them up).
    key: the run's key, which a report must verify with (None: any is read, the quorum's unit
        tests only: a launcher always has one).
    say: called with one line for each report refused, once per report (the launcher's log).
    """

    def __init__(
        self,
        store: dist.Store,
        slots: int,
        key: RunKey | None = None,
        say: Callable[[str], None] = print,
    ):
        self.store, self.slots, self.key, self.say = store, slots, key, say
        self.refused: set[tuple[str, bytes]] = set()  # said already

    def reports(self, generation: int) -> dict[int, Report]:
        """The authentic reports written so far for `generation`, by slot."""
        found = {}
        for slot in range(self.slots):
            key = report_key(generation, slot)
            if not self.store.check([key]):
                continue
            text = self.store.get(key)
            if self.key is None:
                found[slot] = Report.from_json(text)
                continue
            try:
                found[slot] = Report.from_json(self.key.verify(text, purpose=key)["body"])
            except Refused as refused:
                if (key, text) not in self.refused:
                    self.refused.add((key, text))
                    self.say(f"the report in {key} refused: {refused}; the run goes on")
        return found

    def publish(self, membership: Membership) -> None:
        self.store.set(decision_key(membership.generation), membership.to_json())
        self.store.set(LATEST, str(membership.generation))

    def ask_regroup(self, generation: int) -> None:
        self.store.set(regroup_key(generation), "1")

    def release(self, slot: int) -> None:
        self.store.set(leave_key(slot), "1")

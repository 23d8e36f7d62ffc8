"""The quorum of a live run without processes: the membership rule ([Note: membership]) and the
store protocol ([Note: quorum keys]) on an in-memory store."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dataparallel.comm.membership import (
    EVAL,
    JOIN,
    STEP,
    Membership,
    QuorumError,
    QuorumPolicy,
    Report,
    decide,
    first_membership,
    left_out,
    waiting_to_join,
)
from dataparallel.comm.quorum import Quorum, QuorumHost

POLICY = QuorumPolicy(join_timeout_s=30.0)


def _reports(*entries) -> dict[int, Report]:
    """(slot, step) or (slot, step, where) -> {slot: Report}."""
    return {e[0]: Report(replica=e[0], step=e[1], where=(e[2:] or (STEP,))[0]) for e in entries}


def test_the_first_generation_is_everyone_at_step_0_with_nobody_healed():
    first = first_membership(3)
    assert first.generation == -1 and first.members == (0, 1, 2)
    waiting = decide(first, _reports((0, 0), (2, 0)), alive={0, 1, 2}, waited_s=0.0)
    assert waiting is None  # slot 1 is alive and has not reported yet
    decided = decide(first, _reports((0, 0), (1, 0), (2, 0)), {0, 1, 2}, 0.0)
    assert decided == Membership(generation=0, members=(0, 1, 2), step=0, source=0, healed=())
    assert [decided.rank_of(s) for s in (0, 1, 2)] == [0, 1, 2]


def test_a_dead_member_is_not_waited_for():
    current = Membership(generation=0, members=(0, 1, 2))
    decided = decide(current, _reports((0, 40), (2, 40)), alive={0, 2}, waited_s=0.0)
    assert decided.generation == 1 and decided.members == (0, 2)
    assert decided.step == 40 and decided.healed == ()
    assert [decided.rank_of(0), decided.rank_of(2)] == [0, 1]  # slot 2 is rank 1 now
    assert left_out(current, decided) == [1]


def test_a_silent_live_member_is_left_out_after_the_timeout_only():
    current = Membership(generation=3, members=(0, 1, 2))
    reports = _reports((0, 7), (1, 7))
    assert decide(current, reports, {0, 1, 2}, waited_s=29.9, policy=POLICY) is None
    decided = decide(current, reports, {0, 1, 2}, waited_s=30.0, policy=POLICY)
    assert decided.members == (0, 1) and left_out(current, decided) == [2]


def test_a_replacement_takes_the_lost_slot_and_is_healed_from_the_lowest_member_ahead():
    current = Membership(generation=1, members=(0, 2), step=40)
    reports = _reports((0, 52), (1, 0, JOIN), (2, 52))
    assert waiting_to_join(reports) == [1]
    decided = decide(current, reports, alive={0, 2}, waited_s=0.0)
    assert decided.members == (0, 1, 2) and decided.step == 52
    assert decided.source == 0 and decided.healed == (1,)


def test_a_replacement_in_a_slot_of_the_last_generation_is_new_by_what_it_says():
    """Slot 1 was a member; its replacement reports JOIN: it is healed, not a source."""
    current = Membership(generation=0, members=(0, 1, 2))
    decided = decide(current, _reports((0, 9), (1, 0, JOIN), (2, 9)), {0, 2}, 0.0)
    assert decided.members == (0, 1, 2) and decided.source == 0 and decided.healed == (1,)


def test_members_behind_are_healed_and_the_step_is_the_largest():
    """A member that finished step 13 while another rewound it: the one behind is healed."""
    current = Membership(generation=2, members=(0, 1, 2))
    decided = decide(current, _reports((0, 12), (1, 13), (2, 12)), {0, 1, 2}, 0.0)
    assert decided.step == 13 and decided.source == 1 and decided.healed == (0, 2)


def test_no_replacement_joins_members_that_are_evaluating():
    current = Membership(generation=4, members=(0, 2), step=30)
    decided = decide(current, _reports((0, 30, EVAL), (1, 0, JOIN), (2, 30, EVAL)), {0, 2}, 0.0)
    assert decided.members == (0, 2) and decided.healed == ()


def test_replacements_alone_wait_for_the_members_then_fail():
    current = Membership(generation=5, members=(0, 1))
    reports = _reports((1, 0, JOIN))
    assert decide(current, reports, alive=set(), waited_s=1.0, policy=POLICY) is None
    with pytest.raises(QuorumError, match="no replica of generation 5 reported within 30 s"):
        decide(current, reports, alive=set(), waited_s=30.0, policy=POLICY)


def test_reports_and_memberships_travel_as_json():
    report = Report(replica=2, step=17, where=EVAL, pid=4242)
    assert Report.from_json(report.to_json()) == report
    membership = Membership(generation=3, members=(0, 2), step=17, source=2, healed=(0,))
    assert Membership.from_json(membership.to_json()) == membership
    with pytest.raises(ValueError, match="where='later' must be one of"):
        Report(replica=0, step=0, where="later")


def test_the_store_protocol_from_reports_to_a_decision():
    store = dist.HashStore()
    host = QuorumHost(store, slots=3)
    workers = [Quorum(store, replica=r, poll_s=0.001) for r in range(3)]
    assert workers[0].latest() == -1 and host.reports(0) == {}
    for quorum in workers:
        quorum.report(0, Report(replica=quorum.replica, step=0, pid=100 + quorum.replica))
    reports = host.reports(0)
    assert sorted(reports) == [0, 1, 2] and reports[2].pid == 102
    host.publish(decide(first_membership(3), reports, {0, 1, 2}, 0.0))
    assert workers[1].wait(0, timeout_s=1.0).members == (0, 1, 2)
    assert workers[2].latest() == 0
    assert not workers[0].regroup_asked(0)
    host.ask_regroup(0)
    assert workers[0].regroup_asked(0)
    with pytest.raises(TimeoutError, match="no decision for generation 1 within 0.05 s"):
        workers[0].wait(1, timeout_s=0.05)

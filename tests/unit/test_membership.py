"""The quorum of a live run without processes: the membership rule ([Note: membership]) and the
store protocol ([Note: quorum keys]) on an in-memory store."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch.distributed as dist

from dataparallel.train.live.membership import (
    EVAL,
    JOIN,
    LEAVE,
    STEP,
    BelowMinimum,
    Membership,
    QuorumError,
    QuorumPolicy,
    Report,
    decide,
    first_membership,
    gone,
    refuse_join,
    refuse_leave,
    waiting_to_join,
)
from dataparallel.train.live.quorum import Quorum, QuorumHost
from dataparallel.train.live.requests import Answer, Desk, Request, ask
from dataparallel.train.live.store import request_key

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
    assert gone(current, decided) == [1]


def test_a_silent_live_member_is_left_out_after_the_timeout_only():
    current = Membership(generation=3, members=(0, 1, 2))
    reports = _reports((0, 7), (1, 7))
    assert decide(current, reports, {0, 1, 2}, waited_s=29.9, policy=POLICY) is None
    decided = decide(current, reports, {0, 1, 2}, waited_s=30.0, policy=POLICY)
    assert decided.members == (0, 1) and gone(current, decided) == [2]


def test_after_a_timed_out_collective_a_silent_member_is_left_out_after_the_grace():
    """A report of a timed-out collective: a peer stalled, and the healthy members' collectives
    of the same step have failed too; the silent one is dropped grace_s later, not after the
    whole join timeout (stall -> collective timeout + grace_s). A report of a closed
    connection (a kill) does not shorten the wait: members blocked on a survivor report only
    at their own timeout."""
    current = Membership(generation=3, members=(0, 1, 2))
    stalled = {r: Report(replica=r, step=7, timed_out=True) for r in (0, 1)}
    assert decide(current, stalled, {0, 1, 2}, 9.9, POLICY, timed_out_s=9.9) is None
    decided = decide(current, stalled, {0, 1, 2}, 10.0, POLICY, timed_out_s=10.0)
    assert decided.members == (0, 1) and gone(current, decided) == [2]
    killed = _reports((0, 7))  # slot 1 blocked on slot 0 until its own timeout
    assert decide(current, killed, {0, 1, 2}, waited_s=10.0, policy=POLICY) is None
    assert Report.from_json(stalled[0].to_json()).timed_out


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


def test_replacements_alone_wait_for_the_members_alive_then_fail():
    current = Membership(generation=5, members=(0, 1))
    reports = _reports((1, 0, JOIN))
    assert decide(current, reports, alive={0}, waited_s=1.0, policy=POLICY) is None
    with pytest.raises(QuorumError, match="no replica of generation 5 reported within 30 s"):
        decide(current, reports, alive={0}, waited_s=30.0, policy=POLICY)


def test_replacements_alone_with_no_member_alive_stop_the_run_at_once():
    """Member 0 died while it healed member 1, a replacement that reports JOIN again: nobody
    holds the state, and waiting the join timeout would only delay the error."""
    current = Membership(generation=1, members=(0, 1), step=3, source=0, healed=(1,))
    reports = _reports((0, 0, JOIN), (1, 0, JOIN))
    for alive in (set(), {1}, {0, 1}):  # 3 cases: the replacements' processes count or not
        with pytest.raises(QuorumError, match=r"every replica of generation 1 was lost \(members"):
            decide(current, reports, alive=alive, waited_s=0.0, policy=POLICY)


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
    workers = [Quorum(store, slot=r, poll_s=0.001) for r in range(3)]
    assert workers[0].latest() == -1 and host.reports(0) == {}
    for quorum in workers:
        quorum.report(0, Report(replica=quorum.slot, step=0, pid=100 + quorum.slot))
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


# -- membership changes: joins, leaves, minimum and maximum sizes ([Note: membership]) ----------
SIZES = QuorumPolicy(join_timeout_s=30.0, min_replicas=2, max_replicas=4)


def test_a_joiner_gets_a_new_slot_and_is_healed_like_a_replacement():
    current = Membership(generation=2, members=(0, 1), step=8)
    reports = _reports((0, 11), (1, 11), (2, 0, JOIN))
    decided = decide(current, reports, alive={0, 1}, waited_s=0.0, policy=SIZES)
    assert decided == Membership(generation=3, members=(0, 1, 2), step=11, source=0, healed=(2,))
    assert decided.rank_of(2) == 2


def test_no_replica_joins_generation_0():
    """The workers started together meet in generation 0 without a heal: a joiner waits."""
    decided = decide(first_membership(2), _reports((0, 0), (1, 0), (2, 0, JOIN)), {0, 1}, 0.0)
    assert decided.members == (0, 1) and decided.healed == ()


def test_a_leaver_is_not_in_the_next_generation_and_nothing_is_healed():
    current = Membership(generation=3, members=(0, 1, 2), step=11)
    reports = _reports((0, 20), (1, 20, LEAVE), (2, 20))
    decided = decide(current, reports, alive={0, 1, 2}, waited_s=0.0, policy=SIZES)
    assert decided == Membership(generation=4, members=(0, 2), step=20, source=0, healed=())
    assert gone(current, decided) == [1] and decided.rank_of(2) == 1


def test_a_leaver_ahead_of_the_others_does_not_set_the_step():
    """Its update of step 21 is dropped with it: the staying members redo that step."""
    current = Membership(generation=3, members=(0, 1, 2))
    decided = decide(current, _reports((0, 20), (1, 21, LEAVE), (2, 20)), {0, 1, 2}, 0.0)
    assert decided.members == (0, 2) and decided.step == 20 and decided.healed == ()


def test_joiners_beyond_the_maximum_wait_lowest_slots_first():
    """At most 4: the replacement of slot 1 and the joiner in slot 3 enter; slot 4 waits."""
    current = Membership(generation=5, members=(0, 2), step=30)
    reports = _reports((0, 31), (1, 0, JOIN), (2, 31), (3, 0, JOIN), (4, 0, JOIN))
    decided = decide(current, reports, alive={0, 2}, waited_s=0.0, policy=SIZES)
    assert decided.members == (0, 1, 2, 3) and decided.healed == (1, 3)


def test_below_the_minimum_the_decider_waits_for_replicas_on_their_way_then_stops():
    current = Membership(generation=6, members=(0, 1), step=40)
    alone = _reports((0, 41))
    assert decide(current, alone, {0}, waited_s=29.9, policy=SIZES, arriving=1) is None
    with pytest.raises(BelowMinimum, match="generation 7 would have 1 replica.s., fewer than "):
        decide(current, alone, {0}, waited_s=30.0, policy=SIZES, arriving=1)
    with pytest.raises(BelowMinimum, match="--min-replicas 2"):  # nobody on the way: at once
        decide(current, alone, {0}, waited_s=0.0, policy=SIZES, arriving=0)
    decided = decide(current, _reports((0, 41), (1, 0, JOIN)), {0}, 3.0, SIZES, arriving=0)
    assert decided.members == (0, 1) and decided.healed == (1,)  # the replacement arrived
    with pytest.raises(BelowMinimum):  # evaluating: nobody can enter, so nobody is waited for
        decide(current, _reports((0, 40, EVAL)), {0}, waited_s=0.0, policy=SIZES, arriving=1)
    with pytest.raises(BelowMinimum):  # generation 0 is the workers started together
        decide(first_membership(2), _reports((0, 0)), {0}, 0.0, SIZES, arriving=1)


def test_the_door_keeps_the_sizes():
    assert refuse_join(3, SIZES) is None
    assert refuse_join(4, SIZES) == (
        "the run has 4 replica(s), its maximum (--max-replicas 4); start it with a larger "
        "--max-replicas, or wait for one to leave"
    )
    assert refuse_join(100, QuorumPolicy()) is None  # 0: no bound
    assert refuse_leave(2, [0, 1, 2], SIZES) is None
    assert refuse_leave(1, [0, 1], SIZES) == (
        "1 replica(s) would stay, fewer than --min-replicas 2; add one first "
        "(dataparallel join RUN_DIR)"
    )
    assert refuse_leave(5, [0, 2, 1], SIZES) == (
        "replica 5 is not a member of the run (its members: [0, 1, 2])"
    )
    with pytest.raises(ValueError, match="max_replicas=1 must be 0 .no bound. or >= min"):
        QuorumPolicy(min_replicas=2, max_replicas=1)


def test_joins_and_leaves_are_asked_and_answered_through_the_store():
    store = dist.HashStore()
    desk = Desk(store)
    assert desk.pending() == []
    store.add("requests", 1)  # a client that took number 1 and died before writing its request
    join = Request(kind=JOIN, pid=4242, host="node7")
    store.add("requests", 1)
    store.set(request_key(2), join.to_json())
    assert desk.pending() == [(2, join)] and desk.pending() == [] and desk.unread == [1]
    desk.answer(2, Answer(ok=True, message="joined as replica 3", replica=3))
    # A client asks in a thread while the "launcher" answers: number 3.
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(ask(store, Request(kind=LEAVE, replica=1)))
    )
    thread.start()
    while not (pending := desk.pending()):
        time.sleep(0.01)
    assert pending == [(3, Request(kind=LEAVE, replica=1))]
    desk.answer(3, Answer(ok=False, message="no"))
    thread.join(timeout=5)
    assert answers == [Answer(ok=False, message="no")]
    with pytest.raises(ValueError, match="kind='stay' must be 'join' or 'leave'"):
        Request(kind="stay")
    host, member = QuorumHost(store, slots=4), Quorum(store, slot=3)
    assert not member.released()
    host.release(3)
    assert member.released() and not Quorum(store, slot=2).released()


def test_a_released_member_reports_leave_and_ends_once_the_others_went_on():
    from dataparallel.train.live.recovery import LiveRecovery, Phase, Released

    store = dist.HashStore()
    member = LiveRecovery(store, slot=1, joining=False, timeout_s=5.0)
    QuorumHost(store, slots=3).release(1)
    assert member.quorum.released()
    report = Report(replica=1, step=22, where=LEAVE)
    QuorumHost(store, slots=3).publish(Membership(generation=2, members=(0, 2), step=22))
    with pytest.raises(Released, match="replica 1 left the run at step 22; generation 2 goes on"):
        member._meet(2, report)
    assert member.phase is Phase.RELEASED
    assert Report.from_json(store.get("gen/2/report/1")) == report


def test_the_ranks_of_an_hsdp_replica_in_a_generation():
    """Index i of the replica at position p is rank p x S + i: every rank keeps its place in
    its shard group from one generation to the next."""
    from dataparallel.train.live.replica import Seat

    membership = Membership(generation=3, members=(0, 2, 5), source=2)
    seat = Seat(index=1, shard=2)
    assert seat.rank(membership, 5) == 5 and seat.size(membership) == 6
    assert seat.heal_source(membership) == 3 and not seat.leader


def test_the_ranks_of_an_hsdp_replica_vote_through_the_store():
    """[Note: HSDP replicas]: every rank of a replica learns whether one failed, round by round;
    a sibling that never votes loses the replica (one line), it does not hang."""
    import threading

    import pytest

    from dataparallel.train.live.replica import ReplicaLost, ReplicaVote, Seat

    store = dist.HashStore()
    votes = [ReplicaVote(store, 1, Seat(index=i, shard=2, start=7), 5.0) for i in (0, 1)]
    for failed in [(False, False), (True, False), (False, False), (False, True)]:
        results = [None, None]

        def vote(i, failed=failed, results=results):
            results[i] = votes[i](failed[i])

        threads = [threading.Thread(target=vote, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == [not any(failed)] * 2
    votes[0].wait_s = 0.2
    with pytest.raises(ReplicaLost, match="replica 1: 1 of its ranks did not vote within 0.2 s"):
        votes[0](False)


def test_a_generation_forms_once_every_rank_has_arrived():
    """[Note: quorum keys]: a rank lost after the decision never arrives; the others stop
    waiting at the timeout (gloo would wait for it for good) and regroup without it."""
    import time

    from dataparallel.train.live.quorum import Quorum

    store = dist.HashStore()
    first, second = Quorum(store, 0), Quorum(store, 1)
    second.store.set("gen/4/arrived/1", "1")  # rank 1 came first
    assert first.arrive(4, 0, 2, timeout_s=5.0)
    started = time.monotonic()
    assert not first.arrive(5, 0, 2, timeout_s=0.2)  # rank 1 was lost: nobody comes
    assert 0.2 <= time.monotonic() - started < 2.0


class _Slot(int):
    """A slot that counts the comparisons made with it (the rule's work, not its time)."""

    compared = 0

    def __eq__(self, other):
        _Slot.compared += 1
        return int(self) == int(other)

    def __lt__(self, other):
        _Slot.compared += 1
        return int(self) < int(other)

    __hash__ = int.__hash__


@pytest.mark.parametrize("replicas", [100, 1000, 4000])
def test_a_decision_compares_slots_a_number_of_times_near_linear_in_the_replicas(replicas):
    """Every slot reports, a tenth of them behind, a hundredth more join: `decide` and `gone`
    compare slots O(R log R) times (sorting), never once per member per report (R^2: a
    decision at 10,000 replicas took 0.3 s of CPU, BENCHMARKS.md "Cost as the world grows")."""
    slots = [_Slot(r) for r in range(replicas + replicas // 100 + 1)]
    previous = Membership(generation=3, members=tuple(slots[:replicas]))
    reports = {
        s: Report(replica=s, step=99 if s % 10 == 0 else 100, where=STEP if s < replicas else JOIN)
        for s in slots
    }
    _Slot.compared = 0
    decided = decide(previous, reports, set(slots[:replicas]), 0.0)
    assert gone(previous, decided) == []
    assert decided.size == len(slots) and decided.step == 100 and decided.source == 1
    assert len(decided.healed) == replicas // 10 + replicas // 100 + 1
    assert _Slot.compared <= 4 * replicas * math.log2(replicas)

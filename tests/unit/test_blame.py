"""[Note: blame]: the straggler rule, without processes."""

import pytest

from dataparallel.train.blame import StragglerRule, Stragglers, step_scores


def test_a_score_is_the_time_over_the_other_ranks_median():
    assert step_scores([1.0, 1.0, 3.0, 1.0]) == [1.0, 1.0, 3.0, 1.0]
    assert step_scores([0.1, 0.3]) == pytest.approx([1 / 3, 3.0])
    assert step_scores([0.5]) == [1.0]


def test_a_rank_persistently_slower_is_named_once_until_it_recovers():
    stragglers = Stragglers(StragglerRule(window=4, slower_by=0.5))
    fast, slow = [1.0, 1.0, 1.0], [1.0, 1.0, 2.0]
    assert [stragglers.observe(slow) for _ in range(3)] == [[], [], []]  # the window fills
    assert stragglers.observe(slow) == [2]
    assert stragglers.median_scores() == pytest.approx([2 / 3, 2 / 3, 2.0])
    assert stragglers.observe(slow) == []  # named once
    assert [stragglers.observe(fast) for _ in range(2)] == [[], []]  # median of 2 and 1: 1.5
    assert stragglers.observe(fast) == [] and stragglers.named == set()  # recovered
    assert [stragglers.observe(slow) for _ in range(2)] == [[], [2]]  # median 1.5: named again


def test_one_slow_step_or_a_mildly_slower_rank_is_not_named():
    stragglers = Stragglers(StragglerRule(window=5, slower_by=0.5))
    steps = [[1.0, 1.0, 9.0]] + [[1.0, 1.0, 1.0]] * 4 + [[1.0, 1.4, 1.0]] * 5
    assert [r for times in steps for r in stragglers.observe(times)] == []
    assert Stragglers().observe([3.0]) == []  # a world of one has no stragglers

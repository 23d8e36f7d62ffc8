"""Whole-parameter ownership, the pure parts: which optimizer gets which layout, and who owns
what ([Note: optimizer layout] in strategies/parts/optimizer_layout.py)."""

import random

import pytest
import torch

from dataparallel.strategies.parts.optimizer_layout import ELEMENTWISE, layout_of, unknown_notice
from dataparallel.strategies.parts.owners import assign_owners, bundle_owners


def test_owners_are_balanced_largest_first():
    # 10 onto rank 0, 8 onto 1, 6 onto 2, then 5 onto the lightest (2: 6), 3 onto 1 (8), ...
    assert assign_owners([5, 10, 3, 8, 6, 1], 3) == [2, 0, 1, 1, 2, 0]
    loads = [0, 0, 0]
    for size, owner in zip([5, 10, 3, 8, 6, 1], assign_owners([5, 10, 3, 8, 6, 1], 3), strict=True):
        loads[owner] += size
    assert loads == [11, 11, 11]


def test_equal_sizes_go_round_in_order_and_every_call_agrees():
    sizes = [4] * 7
    assert assign_owners(sizes, 3) == [0, 1, 2, 0, 1, 2, 0]
    assert all(assign_owners(sizes, 3) == assign_owners(list(sizes), 3) for _ in range(3))


def test_more_ranks_than_parameters_leave_ranks_owning_nothing():
    owners = assign_owners([256, 64], 4)
    assert owners == [0, 1]
    assert [owners.count(r) for r in range(4)] == [1, 1, 0, 0]
    assert assign_owners([], 2) == []
    with pytest.raises(ValueError, match="ranks=0"):
        assign_owners([1], 0)


def _owners_by_walking_the_ranks(sizes: list[int], ranks: int) -> list[int]:
    """The rule as first written: each parameter, largest first, onto min over every rank."""
    owners, loads = [0] * len(sizes), [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (loads[r], r))
        loads[owners[i]] += sizes[i]
    return owners


def test_owners_agree_with_the_walk_over_the_ranks_and_cost_nothing_per_rank():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 4, rng.randint(0, 100)]) for _ in range(rng.randint(0, 30))]
        ranks = rng.randint(1, 40)
        assert assign_owners(sizes, ranks) == _owners_by_walking_the_ranks(sizes, ranks)
    # 10^12 ranks: the work is per parameter (a heap of the ranks given one), never per rank.
    assert assign_owners([3, 9, 9, 1], 10**12) == [2, 0, 1, 3]
    assert assign_owners([3, 9, 9, 1], 2) == [0, 0, 1, 1]


def test_what_each_class_reads_known_declared_or_exact_by_default():
    class Mine(torch.optim.Optimizer):
        pass

    class MyAdamW(torch.optim.AdamW):  # a subclass may change the update: unknown
        pass

    cases = {
        (torch.optim.AdamW, None, None): ("element", True),
        (torch.optim.SGD, None, None): ("element", True),
        (torch.optim.Adafactor, None, None): ("parameter", True),
        (torch.optim.Muon, None, None): ("parameter", True),
        (torch.optim.AdamW, False, None): ("parameter", True),  # a user may ask for owners
        (Mine, None, None): ("all", False),  # unknown: one owner for everything, exact
        (MyAdamW, None, None): ("all", False),
        (Mine, True, None): ("element", True),
        (Mine, None, "group"): ("group", True),
        (Mine, None, "parameter"): ("parameter", True),
        (torch.optim.AdamW, None, "all"): ("all", True),
    }
    assert {k: layout_of(*k) for k in cases} == cases
    assert len(cases) == 11
    assert len(ELEMENTWISE) == 11


def test_a_wrong_declaration_is_one_line_naming_it():
    with pytest.raises(ValueError, match="Adafactor factors .* drop elementwise=True"):
        layout_of(torch.optim.Adafactor, True, None)
    with pytest.raises(ValueError, match="Muon orthogonalises"):
        layout_of(torch.optim.Muon, None, "element")
    with pytest.raises(TypeError, match="elementwise='yes'"):
        layout_of(torch.optim.SGD, "yes", None)
    with pytest.raises(ValueError, match="reads='rows' must be one of 'element', 'parameter'"):
        layout_of(torch.optim.SGD, None, "rows")
    with pytest.raises(ValueError, match="pass elementwise or reads, not both"):
        layout_of(torch.optim.SGD, True, "element")


def test_the_unknown_class_notice_is_one_line_with_the_declarations():
    line = unknown_notice(torch.optim.Optimizer, "zero2")
    assert "\n" not in line and line.startswith("build_optimizer: Optimizer is a class")
    assert "under zero2" in line and "elementwise=True" in line and "reads='parameter'" in line


def test_bundles_go_whole_to_one_owner_largest_first():
    # Alone, each parameter is placed as assign_owners places it.
    assert bundle_owners([5, 10, 3], [None] * 3, 2) == assign_owners([5, 10, 3], 2)
    # One bundle of everything: one rank owns it all, the others nothing.
    assert bundle_owners([5, 10, 3], ["all"] * 3, 3) == [0, 0, 0]
    # Two groups: the larger (10 + 1) on rank 0, the other (5 + 3) on rank 1.
    assert bundle_owners([5, 10, 3, 1], ["g0", "g1", "g0", "g1"], 2) == [1, 0, 1, 0]
    # A bundle and loose parameters together: the bundle counts as its total.
    assert bundle_owners([4, 4, 6], ["b", "b", None], 2) == [0, 0, 1]


def test_a_tensor_parallel_shard_is_refused_whole_parameters_in_one_line():
    from torch import nn

    from dataparallel.strategies.parts import tensor_parallel
    from dataparallel.strategies.parts.owners import own_groups

    class ShardedOverTp:  # what localize_parameters attaches, reduced to what is read
        def norm_groups(self):
            return ("tp",)

    p = nn.Parameter(torch.zeros(4, 8))
    setattr(p, tensor_parallel._ATTR, ShardedOverTp())
    with pytest.raises(ValueError, match=r"Muon needs whole parameters.*\[4, 8\] is tensor-par"):
        own_groups([[p]], [], comm=None, who="Muon")


def test_a_grouped_optimizer_refuses_what_no_inner_optimizer_would_step():
    """Keyword arguments for a class no group uses, and a group added after the build, would
    reach no inner optimizer: each is refused in one line, not dropped."""
    from dataparallel.strategies.parts.grouped import Grouped, GroupedOptimizer

    a, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="reach none"):
        Grouped([torch.optim.Adam, torch.optim.AdamW], torch.optim.SGD)(
            [{"params": [a]}, {"params": [b]}], lr=0.1
        )
    built = GroupedOptimizer(
        [{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}],
        [torch.optim.SGD, torch.optim.AdamW],
        {},
    )
    assert [g["lr"] for g in built.param_groups] == [0.1, 0.01]
    with pytest.raises(ValueError, match="no inner optimizer"):
        built.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})

"""Whole-parameter ownership, the pure parts: which optimizer gets which layout, and who owns
what ([Note: optimizer layout] in strategies/parts/owners.py)."""

import random

import pytest
import torch

from dataparallel.strategies.parts.owners import ELEMENTWISE, assign_owners, whole_parameters


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


def test_which_optimizers_get_whole_parameters():
    cases = {
        (torch.optim.AdamW, None): False,
        (torch.optim.SGD, None): False,
        (torch.optim.Adafactor, None): True,
        (torch.optim.Muon, None): True,
        (torch.optim.AdamW, False): True,  # a user may ask for whole parameters
    }

    class Mine(torch.optim.Optimizer):
        pass

    class MyAdamW(torch.optim.AdamW):  # a subclass may change the update: unknown
        pass

    cases[Mine, None] = True
    cases[MyAdamW, None] = True
    cases[Mine, True] = False
    assert {k: whole_parameters(*k) for k in cases} == cases
    assert len(cases) == 8
    assert len(ELEMENTWISE) == 11


def test_declaring_a_whole_tensor_optimizer_elementwise_is_refused():
    with pytest.raises(ValueError, match="Adafactor factors .* drop elementwise=True"):
        whole_parameters(torch.optim.Adafactor, True)
    with pytest.raises(TypeError, match="elementwise='yes'"):
        whole_parameters(torch.optim.SGD, "yes")


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

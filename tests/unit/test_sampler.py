"""The distributed sampler: shards, determinism, padding, resume."""

import pytest
import torch

from dataparallel import DistributedSampler


def shards(n, world, **kw):
    return [list(DistributedSampler(n, rank=r, world_size=world, **kw)) for r in range(world)]


def test_shards_are_disjoint_equal_and_cover_the_data():
    parts = shards(12, 3, seed=1)
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(i for p in parts for i in p) == list(range(12))


def test_padding_wraps_round_and_drop_last_drops():
    padded = shards(10, 4, seed=0)
    assert [len(p) for p in padded] == [3, 3, 3, 3]
    flat = [i for p in padded for i in p]
    assert set(flat) == set(range(10)) and len(flat) == 12
    dropped = shards(10, 4, seed=0, drop_last=True)
    assert [len(p) for p in dropped] == [2, 2, 2, 2]
    assert len({i for p in dropped for i in p}) == 8


def test_same_seed_same_order_and_epochs_reshuffle():
    a = DistributedSampler(100, rank=1, world_size=2, seed=5)
    b = DistributedSampler(100, rank=1, world_size=2, seed=5)
    assert list(a) == list(b)
    a.set_epoch(1)
    b.set_epoch(0)
    assert list(a) != list(b)
    assert list(DistributedSampler(9, rank=0, world_size=1, shuffle=False)) == list(range(9))


def test_resume_mid_epoch_continues_with_the_next_index():
    sampler = DistributedSampler(50, rank=0, world_size=2, seed=3)
    sampler.set_epoch(2)
    full = list(sampler.shard().tolist())
    it = iter(sampler)
    first = [next(it) for _ in range(7)]
    state = sampler.state_dict()
    resumed = DistributedSampler(50, rank=0, world_size=2, seed=3)
    resumed.load_state_dict(state)
    assert state["epoch"] == 2 and state["position"] == 7
    assert first + list(resumed) == full
    assert sampler.state_dict(consumed=5)["position"] == 5


def test_bad_inputs_are_clear():
    with pytest.raises(ValueError, match="3 samples cannot be shared by 4 ranks"):
        DistributedSampler(3, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank=2 must be in"):
        DistributedSampler(10, rank=2, world_size=2)
    state = DistributedSampler(10, rank=0, world_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 in the checkpoint but 2 now"):
        DistributedSampler(10, rank=0, world_size=2, seed=2).load_state_dict(state)


def test_shard_is_a_tensor_of_indices():
    assert DistributedSampler(8, rank=1, world_size=2, shuffle=False).shard().tolist() == [
        1,
        3,
        5,
        7,
    ]
    assert isinstance(DistributedSampler(8, rank=0, world_size=2).shard(), torch.Tensor)

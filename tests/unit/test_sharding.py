"""Shard layouts and the bucket pieces sharding relies on (pure; ZeRO-1/2 in a world of one is
tests/dist/test_zero12_one_rank.py)."""

import random

import pytest
import torch
from torch import nn

from dataparallel.strategies.parts.buckets import Bucket, plan_buckets
from dataparallel.strategies.parts.layout import Piece, ShardLayout, padded_numel

F32, CPU = torch.float32, torch.device("cpu")


# -- ShardLayout: pure arithmetic ------------------------------------------------------------
def test_padding_rounds_up_to_the_world_size():
    assert [padded_numel(n, 3) for n in (0, 1, 3, 13)] == [0, 3, 3, 15]
    assert padded_numel(13, 1) == 13


def test_pieces_of_a_bucket_that_does_not_divide():
    # parameters of 7, 5 and 1 elements: 13, padded to 15 for 3 ranks, 5 elements each
    layout = ShardLayout(sizes=(7, 5, 1), offsets=(0, 7, 12), numel=15, world_size=3)
    assert [layout.shard_range(r) for r in range(3)] == [(0, 5), (5, 10), (10, 15)]
    assert layout.pieces(0) == [Piece(0, 0, 5, 0)]
    assert layout.pieces(1) == [Piece(0, 5, 7, 0), Piece(1, 0, 3, 2)]
    assert layout.pieces(2) == [Piece(1, 3, 5, 0), Piece(2, 0, 1, 2)]  # then 2 of padding


def test_every_element_belongs_to_exactly_one_piece():
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        world = rng.randint(1, 5)
        layout = ShardLayout(tuple(sizes), tuple(offsets), padded_numel(sum(sizes), world), world)
        seen = [[0] * n for n in sizes]
        for rank in range(world):
            lo, _ = layout.shard_range(rank)
            for piece in layout.pieces(rank):
                assert offsets[piece.param] + piece.start == lo + piece.shard_start
                for i in range(piece.start, piece.stop):
                    seen[piece.param][i] += 1
        assert all(count == 1 for counts in seen for count in counts)


def test_holders_and_local_slices_are_the_pieces_found_without_walking_the_ranks():
    rng = random.Random(1)
    cases = 0
    for _ in range(60):
        sizes = [rng.choice([0, 1, rng.randint(1, 50)]) for _ in range(rng.randint(1, 6))]
        world = rng.randint(1, 70)  # many more ranks than elements too: most hold nothing
        layout = ShardLayout.pack(sizes, world)
        for position in range(len(sizes)):
            held = {}
            for rank in range(world):
                piece = next((p for p in layout.pieces(rank) if p.param == position), None)
                if piece is not None:
                    held[rank] = (piece.shard_start, piece.shard_start + piece.numel, piece.start)
                assert layout.local_slice(position, rank) == held.get(rank, (0, 0, 0))
                cases += 1
            assert list(layout.holders(position)) == sorted(held)
    assert cases > 2000
    # A world of 10^12 shards: each call is arithmetic on one parameter, not a walk over ranks.
    huge = ShardLayout.pack([5, 7, 3], 10**12)
    assert [huge.holders(i) for i in range(3)] == [range(0, 5), range(5, 12), range(12, 15)]
    assert huge.local_slice(1, 6) == (0, 1, 1) and huge.local_slice(1, 10**12 - 1) == (0, 0, 0)


def test_layout_refuses_what_cannot_shard_evenly():
    with pytest.raises(ValueError, match="numel=13 must be a multiple of world_size=3"):
        ShardLayout(sizes=(13,), offsets=(0,), numel=13, world_size=3)
    with pytest.raises(ValueError, match="rank=3 is outside 0..2"):
        ShardLayout(sizes=(3,), offsets=(0,), numel=3, world_size=3).shard_range(3)


# -- bucket pieces: groups, lazy buffers -----------------------------------------------------
def test_param_groups_never_share_a_bucket():
    params = [(10, F32, CPU, 0), (10, F32, CPU, 1), (10, F32, CPU, 0), (10, F32, CPU, 1)]
    specs = plan_buckets(params, bucket_bytes=1 << 20, pad_to=3)
    assert sorted((s.group, s.param_indices) for s in specs) == [(0, (0, 2)), (1, (1, 3))]
    assert all(s.numel == 21 for s in specs)


def test_a_lazy_bucket_holds_memory_only_between_first_grad_and_release():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    (spec,) = plan_buckets([(3, F32, CPU), (2, F32, CPU)], bucket_bytes=1 << 20)
    bucket = Bucket(spec, [a, b], lazy=True)
    assert bucket.attach_grads() == [True, True] and bucket.buffer is None
    (a * 2).sum().backward()
    bucket.adopt_grad(0)  # what the reducer does when a's gradient is ready
    assert bucket.buffer[:3].tolist() == [2, 2, 2] and b.grad is None
    assert a.grad.data_ptr() == bucket.buffer.data_ptr()
    bucket.complete()  # at launch: b got no gradient, it contributes zeros
    assert bucket.buffer.tolist() == [2, 2, 2, 0, 0] and b.grad.abs().sum() == 0
    bucket.release()
    assert bucket.buffer is None and a.grad is None and b.grad is None

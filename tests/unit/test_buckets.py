"""The bucket plan: pure logic, no process group."""

import pytest
import torch

from dataparallel.strategies.parts.buckets import plan_buckets

F32, BF16, CPU = torch.float32, torch.bfloat16, torch.device("cpu")


def test_buckets_close_at_the_cap_and_keep_order():
    params = [(250, F32, CPU)] * 8  # 1000 bytes each
    specs = plan_buckets(params, bucket_bytes=2500)
    assert [s.param_indices for s in specs] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [s.index for s in specs] == [0, 1, 2]
    assert specs[0].offsets == (0, 250, 500) and specs[0].numel == 750


def test_first_bucket_is_small_so_communication_starts_early():
    params = [(250, F32, CPU)] * 8
    specs = plan_buckets(params, bucket_bytes=4000, first_bucket_bytes=1000)
    assert [len(s.param_indices) for s in specs] == [1, 4, 3]


def test_dtypes_never_share_a_bucket():
    params = [(10, F32, CPU), (10, BF16, CPU), (10, F32, CPU), (10, BF16, CPU)]
    specs = plan_buckets(params, bucket_bytes=1 << 20)
    assert sorted(s.param_indices for s in specs) == [(0, 2), (1, 3)]
    assert {s.dtype for s in specs} == {F32, BF16}


def test_padding_makes_every_bucket_divisible():
    specs = plan_buckets([(7, F32, CPU), (5, F32, CPU)], bucket_bytes=1 << 20, pad_to=3)
    assert specs[0].numel == 12 and specs[0].offsets == (0, 7)


@pytest.mark.parametrize("bad", [0, -5])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_bytes=.* must be > 0"):
        plan_buckets([(1, F32, CPU)], bucket_bytes=bad)

"""The bucket plan: pure logic, no process group."""

import pytest
import torch

from dataparallel.strategies.parts.buckets import Bucket, plan_buckets

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


def _attached_bucket(lazy=False):
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    (spec,) = plan_buckets([(p.numel(), p.dtype, "cpu") for p in params], 1 << 20, pad_to=4)
    return Bucket(spec, params, lazy=lazy, divisor=2), params


def test_attached_views_let_autograd_add_and_divide_once_at_launch():
    """[Note: attached views]: .grad are the views and autograd adds every gradient into them,
    the bucket's last one too ([Note: launched at the next hook]: held once, never beside the
    bucket); `complete` divides once."""
    bucket, (w, b) = _attached_bucket()
    b.grad = torch.full((4,), 3.0)  # a kept gradient is copied in; a None one zeroed
    assert bucket.attach_views() == [True, False]
    assert w.grad.data_ptr() == bucket.buffer.data_ptr() and b.grad.tolist() == [3.0] * 4
    (w.sum() * 2).backward()  # autograd adds into the view in place
    b.sum().backward()  # the last gradient as well
    assert w.grad.data_ptr() == bucket.buffer.data_ptr()
    assert b.grad.data_ptr() == bucket.views[1].data_ptr()
    bucket.complete()
    assert bucket.buffer.tolist() == [1.0] * 6 + [2.0] * 4 + [0.0] * 2  # halved, padding zero
    assert b.grad.tolist() == [2.0] * 4


def test_a_failed_round_leaves_its_partial_sums_behind():
    """Live recovery drops a failed step's gradients, then regroups (reducer.rebind): the next
    step's views start from zeros, not from the failed step's partial sums (they did once, and
    the next step added onto them: test_live_recovery 3.0e-3 off)."""
    bucket, (w, b) = _attached_bucket()
    assert bucket.attach_views() == [True, True]
    (w.sum() * 2 + b.sum()).backward()  # launched; its collective then fails
    w.grad = b.grad = None  # the rewind's zero_grad(set_to_none=True)
    assert bucket.attach_views() == [True, True]  # the next step starts from zeros
    assert bucket.buffer.tolist() == [0.0] * 12


def test_lazy_attached_bucket_allocates_zeroed_at_its_first_gradient():
    bucket, (w, b) = _attached_bucket(lazy=True)
    assert bucket.attach_views() == [True, True] and bucket.buffer is None
    bucket.allocate_attached()
    assert bucket.buffer.tolist() == [0.0] * 12 and b.grad.data_ptr() != w.grad.data_ptr()
    bucket.release()
    assert bucket.buffer is None and w.grad is None and b.grad is None

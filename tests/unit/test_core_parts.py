"""The shared parts without a process group: the flat shard, the precision rules, the hooks."""

from __future__ import annotations

import pytest
import torch

import dataparallel as dp
from dataparallel.comm import allreduce_hook, low_precision_hook, reduce_hook
from dataparallel.comm.hooks import HookState
from dataparallel.strategies.parts import buckets
from dataparallel.strategies.parts.flat_shard import FlatShard
from dataparallel.strategies.parts.layout import ShardLayout

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


# -- FlatShard: pieces and their gradients ---------------------------------------------------
def shard_of(rank: int) -> FlatShard:
    layout = ShardLayout.pack([3, 4, 2], world_size=2)  # 9 elements -> 10, 5 per rank
    data = torch.arange(10, dtype=F32)[rank * 5 : (rank + 1) * 5].clone()
    return FlatShard(layout, rank, data, [True, True, False])


def test_pieces_view_the_shard_and_follow_the_layout():
    first, second = shard_of(0), shard_of(1)
    assert [None if p is None else p.tolist() for p in first.pieces] == [[0, 1, 2], [3, 4], None]
    assert [None if p is None else p.tolist() for p in second.pieces] == [None, [5, 6], [7, 8]]
    assert len(second.params) == 1  # the frozen third parameter is not the optimizer's
    first.pieces[0].data.add_(10)
    assert first.data[:3].tolist() == [10, 11, 12]


def test_reduced_gradients_start_add_and_skip_unused():
    shard = shard_of(0)
    shard.take_reduced(torch.ones(5))
    shard.attach_grads([True, False, True])  # the second parameter: no rank used it
    assert shard.pieces[0].grad.tolist() == [1, 1, 1] and shard.pieces[1].grad is None
    shard.take_reduced(torch.full((5,), 2.0))  # a second synchronised backward, no step
    shard.attach_grads([False, True, True])
    assert shard.pieces[0].grad.tolist() == [3, 3, 3]  # added to what it held
    assert shard.pieces[1].grad.tolist() == [2, 2]  # started from this round


def test_a_borrowed_gradient_is_copied_out_before_its_memory_is_reused():
    shard, bucket = shard_of(0), torch.full((5,), 4.0)
    shard.take_reduced(bucket, borrow=True)
    shard.attach_grads([True, True, True])
    assert shard.pieces[0].grad.data_ptr() == bucket.data_ptr()  # no copy
    shard.stop_borrowing()
    bucket.fill_(-1)  # the next backward writes into the bucket
    assert shard.pieces[0].grad.tolist() == [4, 4, 4] and shard.pieces[1].grad.tolist() == [4, 4]
    shard.take_reduced(bucket, borrow=True)  # held sums move into the new bucket slice
    assert shard.pieces[0].grad.tolist() == [3, 3, 3]
    assert shard.pieces[0].grad.data_ptr() == bucket.data_ptr()


def test_found_inf_poisons_every_held_gradient():
    shard = shard_of(0)
    shard.take_reduced(torch.ones(5))
    shard.attach_grads([True, True, True])
    assert not shard.nonfinite()
    shard.poison()
    assert all(torch.isnan(g).all() for g in shard.grads()) and shard.nonfinite()


def test_poison_and_launch_keep_padding_zero():
    """[Note: finite padding]: a skipped step's poison never reaches a later sum."""
    shard = shard_of(1)  # the second parameter's last two elements, a frozen one, padding
    shard.take_reduced(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]), borrow=True)
    shard.attach_grads([True, True, True])
    shard.poison()
    assert shard.store[:2].isnan().all() and shard.store[2:].tolist() == [0, 0, 0]
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    spec = buckets.plan_buckets([(p.numel(), F32, "cpu") for p in params], 1 << 20, pad_to=3)[0]
    bucket = buckets.Bucket(spec, params, divisor=2)
    assert (bucket.end, spec.numel) == (7, 9)
    bucket.buffer.fill_(float("nan"))  # what a hook, or a borrowing shard, may leave
    for position, param in enumerate(params):
        param.grad = torch.ones(param.numel())
        bucket.adopt_grad(position)
    bucket.complete()
    assert bucket.buffer.tolist() == [0.5] * 7 + [0, 0]


# -- MixedPrecision: what each field means ---------------------------------------------------
def test_precision_rules():
    full = dp.MixedPrecision()
    assert full.masters(F32) is None and full.bucket_dtype(F32) == F32
    bf16 = dp.MixedPrecision(param_dtype=BF16)
    assert bf16.masters(F32) == F32 and bf16.bucket_dtype(BF16) == BF16
    assert bf16.wire_dtype(BF16) is None
    wide = dp.MixedPrecision(param_dtype=BF16, reduce_dtype=F32)  # accumulate in fp32
    assert wide.bucket_dtype(BF16) == F32 and wide.wire_dtype(BF16) is None
    narrow = dp.MixedPrecision(reduce_dtype=BF16)  # fp32 buckets, bf16 on the wire
    assert narrow.bucket_dtype(F32) == F32 and narrow.wire_dtype(F32) == BF16
    assert dp.MixedPrecision(param_dtype=F16).masters(F32) == F32


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_precision_refuses_a_non_float_dtype(field):
    with pytest.raises(ValueError, match=f"MixedPrecision: {field}=torch.int8 must be None"):
        dp.MixedPrecision(**{field: torch.int8})


@pytest.mark.parametrize("policy", [dp.DDP, dp.ZeRO1, dp.ZeRO2, dp.ZeRO3])
def test_every_policy_takes_the_one_precision_type(policy):
    with pytest.raises(ValueError, match="precision='bf16' must be a dataparallel.MixedPrecision"):
        policy(precision="bf16")


# -- hooks: the reduction interface, against a fake two-rank group ---------------------------
class FakeComm:
    """Rank 0 of 2, where the other rank contributes `other` to every sum (synchronous)."""

    def __init__(self, other: float):
        self.world_size, self.rank, self.other, self.calls = 2, 0, other, []

    def all_reduce(self, tensor, async_op=False):
        self.calls.append(("all_reduce", tensor.numel(), tensor.dtype))
        tensor.add_(self.other)
        return Done()

    def reduce_scatter(self, output, input, async_op=False):
        self.calls.append(("reduce_scatter", input.numel(), input.dtype))
        output.copy_(input.view(-1)[: output.numel()] + self.other)
        return Done()


class Done:
    def is_completed(self):
        return True

    def wait(self):
        return True


class Bucket:
    def __init__(self, shard):
        self.index, self.buffer, self.shard = 0, torch.tensor([1.0, 2.0, 3.0, 4.0]), shard


def test_the_default_hook_reduces_whole_or_to_the_shard():
    comm = FakeComm(10)
    whole = Bucket(None)
    assert reduce_hook(HookState(comm), whole).wait().tolist() == [11, 12, 13, 14]
    sharded = Bucket((0, 2))
    assert reduce_hook(HookState(comm), sharded).wait().tolist() == [11, 12]
    assert [c[0] for c in comm.calls] == ["all_reduce", "reduce_scatter"]


def test_replicas_sum_only_what_this_rank_keeps():
    shard_group, replicas = FakeComm(10), FakeComm(100)
    bucket = Bucket((0, 2))
    result = allreduce_hook(HookState(shard_group, replicas), bucket).wait()
    assert result.tolist() == [111, 112]
    assert replicas.calls == [("all_reduce", 2, F32)]  # the shard, not the whole bucket


def test_low_precision_sends_bf16_and_writes_back_in_the_buckets_dtype():
    comm = FakeComm(0.5)
    bucket = Bucket((2, 4))
    hook = low_precision_hook(BF16, allreduce_hook)
    hook(HookState(comm), bucket).wait()
    assert comm.calls == [("all_reduce", 4, BF16)]
    assert bucket.buffer.dtype == F32 and bucket.buffer[2:].tolist() == [3.5, 4.5]


class _GatherOwn:
    """A comm of `world_size` ranks whose object gather hands back every rank's object as
    `objects` lists (this rank's own where None), recording what each gather carried."""

    def __init__(self, world_size: int, objects=None):
        self.world_size, self.objects, self.gathered = world_size, objects, []

    def all_gather_object(self, obj):
        everyone = [obj] * self.world_size if self.objects is None else self.objects.pop(0)
        self.gathered.append(everyone)
        return everyone


def test_the_model_check_gathers_one_digest_per_rank_and_signatures_only_on_a_mismatch():
    from dataparallel.strategies.base import model_signature, verify_same_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    same = _GatherOwn(4096)
    verify_same_model(model, same)
    assert len(same.gathered) == 1 and {len(d) for d in same.gathered[0]} == {64}
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))
    signatures = [model_signature(model), model_signature(other)]
    digests = _GatherOwn(2)
    digests.objects = [["a" * 64, "b" * 64], signatures]
    expected = r"'1.weight' differs across ranks: rank 0 has 1.weight shape \[2, 3\] float32"
    with pytest.raises(ValueError, match=expected + r", rank 1 has 1.weight shape \[5, 3\]"):
        verify_same_model(model, digests)
    assert len(digests.gathered) == 2

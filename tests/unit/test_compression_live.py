"""A compressed hook's state under live recovery, without processes ([Note: compression across
replicas] in compression/live.py): a rewound step redoes the same numbers, a replacement
receives the shared state only, and int8's residuals follow a regroup."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dataparallel.comm.hooks import HookState
from dataparallel.compression import Quantize, build_hook
from dataparallel.compression.live import StepCopy, load_shared_state, shared_state

# Two buckets: a 32 x 24 matrix and its bias; a 16 x 32 matrix (PowerSGD compresses the
# matrices, the bias goes exact).
SHAPES = {
    0: [(0, torch.Size([32, 24])), (768, torch.Size([24]))],
    1: [(0, torch.Size([16, 32]))],
}
SPECS = ["powersgd:rank=2", "topk:ratio=0.25,momentum=0.9", "int8:block=16", "fp8:block=16"]


def _round(hook, seed: int) -> list[torch.Tensor]:
    """One optimizer step's reduction of both buckets on one rank: the sums it returns."""
    state = HookState(SimpleNamespace(world_size=1, rank=0))
    sums = []
    for index in (1, 0):  # DDP reduces the last parameters' bucket first
        numel = sum(shape.numel() for _, shape in SHAPES[index])
        g = torch.Generator().manual_seed(100 * seed + index)
        bucket = SimpleNamespace(
            index=index, buffer=torch.randn(numel, generator=g), shard=None, shapes=SHAPES[index]
        )
        sums.append(hook(state, bucket).wait().clone())
    return sums


def _state(hook) -> dict:
    stores = hook.compressor.stores()
    return {(name, key): t.clone() for name, store in stores.items() for key, t in store.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("before", [0, 3])  # the first step (PowerSGD draws its Qs) or later
def test_a_rewound_step_redoes_the_same_numbers(spec, before):
    uninterrupted = build_hook(spec)
    for seed in range(before):
        _round(uninterrupted, seed)
    expected = _round(uninterrupted, before)

    hook = build_hook(spec)
    for seed in range(before):
        _round(hook, seed)
    copy = StepCopy(hook)
    copy.take()
    at_start, counters = _state(hook), hook.counters()
    _round(hook, before)  # the interrupted step changed the state before its collective failed
    assert not _equal(_state(hook), at_start) and hook.counters() != counters
    copy.restore()
    assert _equal(_state(hook), at_start) and hook.counters() == counters
    redone = _round(hook, before)
    assert all(torch.equal(a, b) for a, b in zip(redone, expected, strict=True))
    assert _equal(_state(hook), _state(uninterrupted)) and hook.rounds == before + 1


def test_the_copy_reuses_its_buffers_and_the_restore_hands_out_new_tensors():
    hook = build_hook("topk:ratio=0.25")
    _round(hook, 0)
    copy = StepCopy(hook)
    copy.take()
    buffers = {k: v.data_ptr() for k, v in copy.copies.items()}
    _round(hook, 1)
    copy.take()
    assert {k: v.data_ptr() for k, v in copy.copies.items()} == buffers  # no allocation
    live = hook.compressor.feedback.residuals[(0, "all")]
    copy.restore()
    restored = hook.compressor.feedback.residuals[(0, "all")]
    assert restored.data_ptr() not in (live.data_ptr(), buffers[("residual", (0, "all"))])


def test_a_replacement_receives_the_shared_state_and_starts_its_own_at_zero():
    source = build_hook("powersgd:rank=2")
    for seed in range(3):
        _round(source, seed)
    replacement = build_hook("powersgd:rank=2")
    load_shared_state(replacement, shared_state(source))
    theirs, ours = source.compressor, replacement.compressor
    assert replacement.rounds == source.rounds == 3
    for name in ("p", "q"):  # equal, and copies
        stores = ours.stores()[name], theirs.stores()[name]
        assert stores[0].keys() == stores[1].keys() == {(0, "all"), (1, "all")}
        for key, tensor in stores[0].items():
            assert torch.equal(tensor, stores[1][key])
            assert tensor.data_ptr() != stores[1][key].data_ptr()
    assert ours.feedback.residuals == {} and len(theirs.feedback.residuals) == 2
    assert ours.rng.randint(10**9) == theirs.rng.randint(10**9)  # the same draws to come
    # With the same Q, the same rank's bucket (residual zero on both) gives the same sum.
    fresh = build_hook("powersgd:rank=2")
    load_shared_state(fresh, shared_state(source))
    source.compressor.feedback.residuals.clear()
    assert all(torch.equal(a, b) for a, b in zip(_round(fresh, 7), _round(source, 7), strict=True))


@pytest.mark.parametrize("spec", ["topk:ratio=0.25,momentum=0.9", "int8:block=16"])
def test_residuals_and_velocities_are_each_ranks_own(spec):
    source = build_hook(spec)
    for seed in range(2):
        _round(source, seed)
    replacement = build_hook(spec)
    load_shared_state(replacement, shared_state(source))
    assert replacement.rounds == 2
    assert all(store == {} for store in replacement.compressor.stores().values())


def test_a_source_with_another_compressor_is_one_clear_line():
    with pytest.raises(ValueError) as error:
        load_shared_state(build_hook("topk:ratio=0.1"), shared_state(build_hook("powersgd")))
    message = str(error.value)
    assert message.startswith("compression: the source's state is powersgd's but this replica")
    assert "\n" not in message


def test_quantised_residuals_follow_a_regroup_without_losing_any():
    """Rank 1 of 3 (chunks of 4 of a 10-entry bucket) becomes rank 0 of 2 (chunks of 5)."""
    quantize = Quantize("int8", block=4)
    key = (0, "all")
    send = torch.arange(1.0, 13.0).view(3, 4)
    send[2, 2:] = 0  # entries 10 and 11 are padding
    gather = torch.tensor([[0.5, 0.25, 0.125, 0.0625]])  # owner of chunk 1: entries 4..7
    quantize.feedback.residuals.update({(key, "send"): send, (key, "gather"): gather})
    quantize.layouts[key] = torch.tensor([1, 3])
    quantize._follow_layout(key, 0, 2, 10)
    owed = torch.arange(1.0, 11.0)
    owed[4:8] += gather[0]
    expected = torch.zeros(2, 8)  # two chunks of 5, a row padded to 2 blocks of 4
    expected[:, :5] = owed.view(2, 5)
    assert torch.equal(quantize.feedback.residuals[(key, "send")], expected)
    assert (key, "gather") not in quantize.feedback.residuals
    assert quantize.layouts[key].tolist() == [0, 2]
    quantize._follow_layout(key, 0, 2, 10)  # the same group again: nothing moves
    assert torch.equal(quantize.feedback.residuals[(key, "send")], expected)


def test_int8_reduces_in_a_smaller_group_after_a_regroup():
    """A residual laid out for 3 ranks would not fit a group of 1 (before: a ValueError)."""
    hook = build_hook("int8:block=16")
    _round(hook, 0)
    quantize = hook.compressor
    for key in [(0, "all"), (1, "all")]:  # as if laid out by rank 2 of 3
        send = quantize.feedback.residuals[(key, "send")]
        numel = send.shape[1]  # one rank: one row of the whole bucket
        laid = quantize._rows(send[0, :numel], 3, quantize._padded(numel, 3))
        quantize.feedback.residuals[(key, "send")] = laid
        quantize.layouts[key] = torch.tensor([2, 3])
    sums = _round(hook, 1)
    assert [s.numel() for s in sums] == [512, 792]
    assert quantize.feedback.residuals[((0, "all"), "send")].shape == (1, 800)

"""Compressors as pure functions: error feedback's invariant, quantisation's error bounds,
PowerSGD's plan of what to compress, the --compress spec, and bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dataparallel as dp
from dataparallel.comm.hooks import HookState, Ready
from dataparallel.compression import (
    CompressedHook,
    ErrorFeedback,
    PowerSGD,
    Quantize,
    TopK,
    build_hook,
    orthogonalize,
    parse_spec,
    plan_matrices,
)


def _tensors(seed: int, n: int = 4096):
    g = torch.Generator().manual_seed(seed)
    # a heavy-tailed mix, with exact zeros and tiny values, like real gradients
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x[::17] = 0
    return x


def test_topk_error_feedback_is_exact():
    """sent + new residual == came in + old residual, bit for bit, over several steps."""
    topk = TopK(0.05)
    for step in range(5):
        came_in = _tensors(step)
        old = topk.feedback.residuals.get("k", torch.zeros_like(came_in)).clone()
        indices, values = topk.compress("k", came_in.clone())
        sent = TopK.decompress(indices, values, came_in.numel())
        assert indices.numel() == round(0.05 * came_in.numel())
        assert torch.equal(sent + topk.feedback.residuals["k"], came_in + old)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantisation_error_feedback_is_exact(kind):
    quantize = Quantize(kind, block=256)
    for step in range(5):
        rows = _tensors(step).view(4, 1024)
        old = quantize.feedback.residuals.get("k", torch.zeros_like(rows)).clone()
        packed = quantize.round_trip("k", rows.clone())
        sent = quantize.dequantize(packed)
        assert torch.equal(sent + quantize.feedback.residuals["k"], rows + old)


def test_quantisation_error_bounds():
    x = _tensors(7).view(2, 2048)
    for kind, limit in [("int8", 127.0), ("fp8", 448.0)]:
        quantize = Quantize(kind, block=512)
        packed = quantize.quantize(x.clone())
        assert packed.dtype == torch.uint8
        assert packed.shape == (2, 2048 + 4 * 2048 // 512)  # 1 byte per entry + a scale per block
        error = (quantize.dequantize(packed) - x).view(2, -1, 512)
        scale = x.view(2, -1, 512).abs().amax(dim=2, keepdim=True) / limit
        if kind == "int8":  # rounding to nearest: half a step
            assert (error.abs() <= scale * 0.5 * (1 + 1e-6)).all()
        else:  # e4m3: 3 mantissa bits (2^-4 relative), subnormal spacing 2^-9 x scale
            bound = torch.maximum(x.view(2, -1, 512).abs() * 2**-4, scale * 2**-10)
            assert (error.abs() <= bound * (1 + 1e-6)).all()
    # a block of zeros stays zeros (scale 1, not a division by zero)
    zeros = Quantize("int8", block=8)
    assert torch.equal(zeros.dequantize(zeros.quantize(torch.zeros(1, 16))), torch.zeros(1, 16))


def test_powersgd_plans_whole_rows_and_leaves_the_rest_exact():
    shapes = [(0, torch.Size([64, 32])), (2048, torch.Size([64])), (2112, torch.Size([8, 4]))]
    matrices, vectors = plan_matrices(shapes, 0, 2144, 4, 2.0)
    assert matrices == [(0, 64, 32, 4)]  # (64 + 32) x 4 x 2 < 64 x 32; 8 x 4 would not shrink
    assert vectors == [(2048, 2144)]
    # A shard [1000, 1700) cuts rows: whole rows 32..52 compress, the edges travel exact.
    matrices, vectors = plan_matrices(shapes, 1000, 700, 4, 2.0)
    assert matrices == [(1024 - 1000, 21, 32, 4)]
    assert vectors == [(0, 24), (24 + 21 * 32, 700)]


def test_orthogonalize_gives_orthonormal_columns():
    for rank in (1, 2, 4):  # Gram-Schmidt, then QR
        m = torch.randn(1, 50, rank)
        orthogonalize(m)
        assert torch.allclose(m[0].T @ m[0], torch.eye(rank), atol=1e-5)
    zero = torch.zeros(1, 10, 2)
    orthogonalize(zero)  # a zero gradient stays zero, not NaN
    assert torch.equal(zero, torch.zeros(1, 10, 2))


def test_spec_parsing():
    assert parse_spec("powersgd:rank=4,start=10") == ("powersgd", {"rank": 4, "start": 10})
    assert parse_spec("topk:ratio=0.01") == ("topk", {"ratio": 0.01})
    assert parse_spec("int8") == ("int8", {})
    hook = build_hook("powersgd:rank=4,start=10")
    assert isinstance(hook, CompressedHook) and hook.start == 10 and hook.compressor.rank == 4
    assert build_hook("fp8:block=128").compressor.block == 128
    assert build_hook("bf16").__name__ == "bfloat16_hook"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TopK(0.0), "topk: ratio=0.0 must be in (0, 1]"),
        (lambda: TopK(1.5), "topk: ratio=1.5 must be in (0, 1]"),
        (lambda: TopK(0.1, momentum=1.0), "topk: momentum=1.0 must be in [0, 1)"),
        (lambda: PowerSGD(rank=0), "powersgd: rank=0 must be an integer >= 1"),
        (lambda: Quantize("int2"), "quantize: kind='int2' must be one of int8, fp8, int4"),
        (lambda: Quantize("int8", block=6), "quantize: block=6 must be a multiple of 4"),
        (lambda: CompressedHook(TopK(0.1), start=-1), "topk: start=-1 must be an integer >= 0"),
        (lambda: parse_spec("topk:ratio=abc"), "topk: ratio='abc' is not a float"),
        (lambda: parse_spec("bf16:x=1"), "bf16 takes no options"),
        (lambda: build_hook("topk"), "topk: give ratio"),
        (
            lambda: PowerSGD(rank=9).check([torch.Size([8, 4]), torch.Size([8])]),
            "powersgd: rank=9 exceeds what any gradient matrix allows (at most 4",
        ),
        (
            lambda: dp.LocalSGD(torch.nn.Linear(2, 2), None, 0),
            "local-sgd: every=0 must be an integer >= 1",
        ),
        (
            lambda: dp.DiLoCo(torch.nn.Linear(2, 2), None, 5, compress="int2"),
            "diloco: compress='int2' must be None, 'bf16', 'int8', 'fp8' or 'int4'",
        ),
    ],
)
def test_bad_input_is_one_clear_line(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_a_spec_without_options_gets_the_measured_defaults():
    """`powersgd` alone is rank 32, compressed from the first step (docs/compression.md,
    "Compression under Adam"); what a spec gives wins; the class keeps PyTorch's rank 1."""
    hook = build_hook("powersgd")
    assert (hook.compressor.rank, hook.start) == (32, 0)
    hook = build_hook("powersgd:rank=4,start=0")
    assert (hook.compressor.rank, hook.start) == (4, 0)
    assert PowerSGD().rank == 1 and build_hook("topk:ratio=0.1").start == 0


def test_exact_rounds_first_then_compressed():
    """`start` (PyTorch's start_powerSGD_iter): the first `start` rounds take the exact
    reduction, every later one the compressor."""
    compressed = []

    class Recording:
        name = "recording"

        def reduce(self, comm, key, buffer, keep, shapes):
            compressed.append((hook.rounds, key))
            return Ready(buffer)

    hook = CompressedHook(Recording(), start=3)
    state = HookState(SimpleNamespace(world_size=1))  # one rank: the exact path sends nothing
    for _ in range(5):  # five optimizer steps of two buckets
        for index in (1, 0):
            bucket = SimpleNamespace(index=index, buffer=torch.ones(4), shard=None, shapes=[])
            assert hook(state, bucket).wait().tolist() == [1.0] * 4
    assert compressed == [(4, (1, "all")), (4, (0, "all")), (5, (1, "all")), (5, (0, "all"))]


def test_hook_counts_rounds_in_any_bucket_order():
    hook = CompressedHook(TopK(0.5), start=2)
    for index in [2, 1, 0]:  # round 1 (ZeRO-3 reduces units last to first)
        hook._count_round(index)
    assert hook.rounds == 1
    for index in [2, 1, 0, 2]:  # round 2, then round 3 begins
        hook._count_round(index)
    assert hook.rounds == 3


def test_a_non_finite_residual_is_dropped_not_fed_back():
    """An fp16 overflow (skipped by the loss scaler) must not poison every later step."""
    feedback = ErrorFeedback()
    assert feedback.remember("k", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.5]))
    assert not feedback.remember("k", torch.tensor([float("inf"), 2.0]), torch.zeros(2))
    assert "k" not in feedback.residuals
    assert torch.equal(feedback.correct("k", torch.ones(2)), torch.ones(2))  # nothing added
    quantize = Quantize("int8", block=4)
    quantize.round_trip("q", torch.tensor([[1.0, float("nan"), 0.0, 0.0]]))
    assert "q" not in quantize.feedback.residuals

"""[Note: sharded gradients] and [Note: partial values]: a model parameter's `.grad` under ZeRO
reads the reduced gradient where it lives. No process group: one rank holds every run (a shard
group of one), so each read must equal PyTorch's own on the plain gradient; the combining over
ranks is tests/dist/test_grad_access.py's."""

from __future__ import annotations

import math

import pytest
import torch

from dataparallel.strategies.parts.held_grads import ShardedGrads
from dataparallel.strategies.parts.partial import Partial
from dataparallel.strategies.parts.sharded_grads import is_sharded_grad


class Held:
    """Where the runs live, reduced to what `ShardedGrad` reads: a run per parameter."""

    comm = None

    def __init__(self, runs: dict):
        self.runs_of = runs

    def runs(self, param):
        run = self.runs_of.get(id(param))
        return [] if run is None else [run]

    def clear(self, param):
        self.runs_of.pop(id(param), None)


def attached(*shapes, seed=0):
    """Parameters with ShardedGrads over runs (views of one flat store, as a shard's are), and
    the plain gradients they stand for."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    plain = [torch.randn(shape) for shape in shapes]
    store = torch.cat([g.reshape(-1) for g in plain])
    runs, start = {}, 0
    for p in params:
        runs[id(p)] = store[start : start + p.numel()]
        start += p.numel()
    grads = ShardedGrads(params, "zero2")
    grads.source = Held(runs)
    grads.attach([True] * len(params))
    return params, plain, grads


READS = {
    "norm": lambda g: g.norm(),
    "norm(1)": lambda g: g.norm(1),
    "norm(inf)": lambda g: g.norm(float("inf")),
    "vector_norm(3)": lambda g: torch.linalg.vector_norm(g, 3),
    "linalg.norm": lambda g: torch.linalg.norm(g),
    "torch.norm": lambda g: torch.norm(g),
    "sum": lambda g: g.sum(),
    "mean": lambda g: g.mean(),
    "max": lambda g: g.max(),
    "min": lambda g: g.min(),
    "amax": lambda g: g.amax(),
    "std": lambda g: g.std(),
    "var(unbiased=False)": lambda g: g.var(unbiased=False),
    "count_nonzero": lambda g: torch.count_nonzero(g),
    "abs().max()": lambda g: g.abs().max(),
    "pow(2).sum()": lambda g: g.pow(2).sum(),
    "(g * 3).norm()": lambda g: (g * 3).norm(),
    "float().mean()": lambda g: g.float().mean(),
    "isfinite().all()": lambda g: torch.isfinite(g).all(),
    "(g > 0).sum()": lambda g: (g > 0).sum(),
    "data.norm(2)": lambda g: g.data.norm(2),
    "(g * g).sum()": lambda g: (g * g).sum(),
}


@pytest.mark.parametrize("read", list(READS))
def test_each_read_equals_pytorchs_on_the_plain_gradient(read):
    params, plain, _ = attached((4, 3), (5,))
    for p, g in zip(params, plain, strict=True):
        got, want = READS[read](p.grad), READS[read](g)
        assert isinstance(got, (Partial, torch.Tensor)) and got.dtype == want.dtype, read
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6), (read, got, want)
    assert len(READS) == 22


def test_torch_clip_grad_norm_scales_the_runs_in_one_combine_and_returns_the_total():
    params, plain, _ = attached((4, 3), (5,), (2, 2, 2))
    want_norm = torch.nn.utils.clip_grad_norm_(_plain_params(plain), 0.5)
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert isinstance(norm, Partial) and norm.value is not None  # combined once, kept
    assert math.isclose(float(norm), float(want_norm), rel_tol=1e-6)
    for p, g in zip(params, _scaled(plain, 0.5), strict=True):
        assert torch.allclose(p.grad.runs()[0].view_as(g), g, atol=1e-7)
    for foreach in (True, False):
        params, plain, _ = attached((4, 3), (5,))
        torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=foreach)
        assert math.isclose(
            float(torch.nn.utils.get_total_norm([p.grad for p in params])), 0.5, rel_tol=1e-5
        )


def test_torch_clip_grad_value_clamps_every_run():
    params, plain, _ = attached((4, 3), (5,))
    torch.nn.utils.clip_grad_value_(params, 0.3)
    for p, g in zip(params, plain, strict=True):
        assert torch.equal(p.grad.runs()[0].view_as(g), g.clamp(-0.3, 0.3))


def test_in_place_changes_reach_the_runs_and_zero_grad_zeroes_them():
    params, plain, _ = attached((4, 3))
    p, g = params[0], plain[0]
    p.grad.mul_(2).div_(4)
    torch._foreach_mul_([p.grad], 3.0)
    assert torch.allclose(p.grad.runs()[0].view_as(g), g * 1.5)
    layer = torch.nn.Module()
    layer.w = p
    layer.zero_grad(set_to_none=False)
    assert is_sharded_grad(p.grad) and float(p.grad.abs().max()) == 0.0


def test_metadata_reads_true_and_elements_are_refused_in_one_line():
    params, _, _ = attached((4, 3))
    grad = params[0].grad
    assert grad is not None and grad.shape == (4, 3) and grad.dtype == torch.float32
    assert grad.size(0) == 4 and grad.dim() == 2 and grad.numel() == 12
    refused = {
        ".grad.__getitem__": lambda g: g[0],
        ".grad.tolist": lambda g: g.tolist(),
        ".grad.matmul": lambda g: g.matmul(torch.ones(3)),
        ".grad.add": lambda g: g + torch.ones(4, 3),  # a whole tensor beside a sharded one
        ".grad.sum": lambda g: g.sum(dim=0),  # along a dimension of a gradient laid flat
    }
    for call, use in refused.items():
        with pytest.raises(RuntimeError) as error:
            use(grad)
        message = str(error.value)
        assert message.startswith(f"{call} on a model parameter's .grad cannot be exact"), message
        assert "under zero2" in message and "\n" not in message


def test_a_placeholder_set_to_none_clears_the_gradient_and_a_replaced_one_is_refused():
    params, _, grads = attached((4, 3), (5,))
    source = grads.source
    params[0].grad = None  # model.zero_grad(): the gradient itself goes, as in one process
    grads.reconcile()
    assert id(params[0]) not in source.runs_of and id(params[1]) in source.runs_of
    params[1].grad = torch.zeros(5)
    with pytest.raises(ValueError, match=r"\(shape \[5\]\) was replaced by another tensor"):
        grads.reconcile()


def test_attach_follows_the_used_flags_and_the_parameters_dtype_and_drop_clears():
    used, unused, frozen = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    frozen.requires_grad_(False)
    grads = ShardedGrads([used, unused, frozen], "zero3")
    grads.source = Held({})
    grads.attach([True, False, True])
    assert is_sharded_grad(used.grad) and unused.grad is None and frozen.grad is None
    first = used.grad
    grads.drop()
    assert used.grad is None
    used.data = used.data.to(torch.bfloat16)  # ZeRO-3 gathers in the compute dtype
    grads.attach([True, False, False])
    assert used.grad.dtype == torch.bfloat16 and used.grad is not first
    grads.drop()
    real = torch.ones(2)
    unused.grad = real
    grads.drop()  # a real gradient is never touched
    assert unused.grad is real


def _plain_params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def _scaled(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coef for g in grads]

"""ZeRO-1/2 in a world of one (a real process group of one rank): the code paths without a
second process. Moved from tests/unit/test_sharding.py, which keeps the pure shard layouts."""

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.strategies.parts.sharded_grads import is_sharded_grad


@pytest.fixture(scope="module", autouse=True)
def world():
    return dp.init()


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)


POLICIES = [
    dp.ZeRO1(bucket_mb=0.0002, first_bucket_mb=0.0001),
    dp.ZeRO1(grad_reduce="reduce_scatter", bucket_mb=0.0002),
    dp.ZeRO2(bucket_mb=0.0002, first_bucket_mb=0.0001),
]


@pytest.mark.parametrize("policy", POLICIES, ids=["zero1", "zero1-rs", "zero2"])
def test_training_equals_plain_adamw_including_accumulation_across_backwards(policy):
    plain, ours = _model(), dp.parallelize(_model(), policy)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt = dp.build_optimizer(ours, torch.optim.AdamW, lr=1e-2)
    clips = {
        plain: lambda: nn.utils.clip_grad_norm_(plain.parameters(), 0.5),
        ours: lambda: dp.clip_grad_norm_(ours, 0.5),
    }
    for step in range(4):
        for model, optimizer in ((plain, plain_opt), (ours, opt)):
            # two synchronised backwards add up before the step, as in plain PyTorch
            for half in _data(step)[0].chunk(2):
                (model(half) ** 2).mean().backward()
            clips[model]()
            optimizer.step()
            optimizer.zero_grad(set_to_none=step % 2 == 0)  # both kinds of zero_grad
    for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-6
    state = dp.optimizer_state_dict(ours, opt)
    reference = plain_opt.state_dict()
    assert state["param_groups"] == reference["param_groups"]
    for index, entry in reference["state"].items():
        for key, value in entry.items():
            assert (state["state"][index][key] - value).abs().max().item() < 1e-6, key


optim = torch.optim
ELEMENTWISE = [
    (optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (optim.AdamW, {"lr": 1e-2}),
    (optim.Adagrad, {"lr": 1e-2}),
    (optim.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.5}),
    (optim.Adamax, {"lr": 1e-2}),
    (optim.NAdam, {"lr": 1e-2}),
    (optim.RAdam, {"lr": 1e-2}),
    (optim.ASGD, {"lr": 1e-2}),
    (optim.Rprop, {"lr": 1e-2}),
    (optim.Adadelta, {"lr": 1.0}),
]


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_every_elementwise_torch_optimizer_steps_exactly(stage):
    """docs/zero.md, "Optimizers other than SGD and Adam": 5 steps, bit for bit."""
    for cls, kwargs in ELEMENTWISE:
        plain, ours = _model(), dp.parallelize(_model(), stage)
        plain_opt, opt = cls(plain.parameters(), **kwargs), dp.build_optimizer(ours, cls, **kwargs)
        for step in range(5):
            for model, optimizer in ((plain, plain_opt), (ours, opt)):
                (model(_data(step)[0]) ** 2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b), cls.__name__


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero1_gradients_live_on_the_optimizer(set_to_none):
    """[Note: consumed sums]: after backward the model's .grad are not the local sums under
    ZeRO-1 but refuse every use ([Note: sharded gradients]), as under ZeRO-2; the reduced
    gradient is the optimizer's, and its zero_grad clears it."""
    plain, ours = _model(), dp.parallelize(_model(), dp.ZeRO1(bucket_mb=0.0002))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = dp.build_optimizer(ours, torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(3):
        for model, optimizer in ((plain, plain_opt), (ours, opt)):
            (model(_data(step)[0]) ** 2).mean().backward()
            if model is ours:
                assert all(is_sharded_grad(p.grad) for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-6


def test_step_without_gradients_changes_nothing():
    model = dp.parallelize(_model(), dp.ZeRO2())
    opt = dp.build_optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_mixed_precision_casts_inputs_and_keeps_fp32_masters():
    model = dp.parallelize(
        _model(), dp.ZeRO2(precision=dp.MixedPrecision(param_dtype=torch.bfloat16))
    )
    opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    out = model(_data(0)[0])  # an fp32 input, cast to bf16 by the strategy
    out.float().pow(2).mean().backward()
    opt.step()
    assert out.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {t.dtype for g in opt.param_groups for t in g["params"]} == {torch.float32}
    assert {v.dtype for v in dp.full_state_dict(model).values()} == {torch.float32}


def test_each_parameter_is_stepped_by_one_optimizer_and_all_are_built_before_a_step():
    model = dp.parallelize(_model(), "zero1")
    first = [p for p in model.parameters() if p.dim() == 2]
    opt = dp.build_optimizer(model, torch.optim.SGD, first, lr=0.1)
    with pytest.raises(ValueError, match="already stepped by an optimizer built for this model"):
        dp.build_optimizer(model, torch.optim.SGD, first[:1], lr=0.1)
    out = model(_data(0)[0])
    out.pow(2).mean().backward()
    opt.step()
    rest = [p for p in model.parameters() if p.dim() < 2]
    with pytest.raises(ValueError, match="every optimizer of a model is built before the first"):
        dp.build_optimizer(model, torch.optim.SGD, rest, lr=0.1)
    other = dp.parallelize(_model(), "zero2")
    with pytest.raises(ValueError, match="builds its own sharded optimizer"):
        dp.build_optimizer(other, torch.optim.SGD(other.parameters(), lr=0.1))


def test_step_with_a_closure_is_refused():
    model = dp.parallelize(_model(), "zero2")
    opt = dp.build_optimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"step\(closure\) is not supported with ZeRO-1/2"):
        opt.step(lambda: model(_data(0)[0]).sum())

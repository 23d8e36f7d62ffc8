"""Bad input at the public API, in a world of one (no second process needed)."""

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.api import strategy_of
from dataparallel.strategies.base import first_mismatch, model_signature


@pytest.fixture(scope="module", autouse=True)
def world():
    yield dp.init()
    dp.destroy()  # the dry run's tests start their fake group in this process later


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown strategy 'dpp'; choose one of .*ddp"):
        dp.parallelize(nn.Linear(2, 2), "dpp")


@pytest.mark.parametrize("field", ["bucket_mb", "first_bucket_mb"])
@pytest.mark.parametrize("value", [0, -1.0])
def test_bucket_size_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"DDP: {field}={value} must be > 0"):
        dp.DDP(**{field: value})


def test_reduce_op_is_checked():
    with pytest.raises(ValueError, match="reduce_op='max' must be 'mean' or 'sum'"):
        dp.DDP(reduce_op="max")


def test_optimizer_for_another_model_is_refused():
    model = dp.parallelize(nn.Linear(2, 2), "ddp")
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not belong to the parallelized model"):
        dp.build_optimizer(model, torch.optim.SGD, params=other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not belong to the parallelized model"):
        dp.build_optimizer(model, torch.optim.SGD(other.parameters(), lr=0.1))
    built = torch.optim.SGD(model.parameters(), lr=0.1)
    assert dp.build_optimizer(model, built) is built
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer class"):
        dp.build_optimizer(model, "adam", lr=0.1)


def test_calls_on_a_model_that_was_not_parallelized():
    with pytest.raises(ValueError, match="call dataparallel.parallelize"):
        dp.build_optimizer(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="call dataparallel.parallelize"):
        dp.no_sync(nn.Linear(2, 2))


def test_pairwise_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match=r"parallelize: pairwise='yes' must be True, False"):
        dp.parallelize(nn.Linear(2, 2), "zero1", pairwise="yes")


def test_the_reducer_needs_room_for_one_reduction_in_flight():
    from dataparallel.comm import Comm, HookState, allreduce_hook
    from dataparallel.strategies.parts.reducer import GradientReducer

    comm = Comm()
    with pytest.raises(ValueError, match="max_in_flight=0 must be >= 1 or None"):
        GradientReducer([], [], comm, allreduce_hook, HookState(comm), max_in_flight=0)


def test_parallelize_twice_is_refused():
    model = dp.parallelize(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already parallelized"):
        dp.parallelize(model)


def test_param_groups_and_world_of_one_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    plain.load_state_dict(model.state_dict())
    dp.parallelize(model)
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters()}]
    opt = dp.build_optimizer(model, torch.optim.SGD, params=groups, lr=0.01)
    ref = torch.optim.SGD(
        [{"params": plain[0].parameters(), "lr": 0.1}, {"params": plain[1].parameters()}], lr=0.01
    )
    x = torch.randn(5, 3)
    for m, o in ((model, opt), (plain, ref)):
        m(x).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_signature_mismatch_is_described_precisely():
    a = model_signature(nn.Sequential(nn.Linear(2, 3)))
    b = model_signature(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    assert first_mismatch([a, a]) is None
    problem = first_mismatch([a, b])
    assert problem == (
        "parameter '1.weight' differs across ranks: rank 0 has nothing at that position, "
        "rank 1 has 1.weight shape [1, 3] float32"
    )


def test_compressed_hook_rejects_other_dtypes():
    with pytest.raises(ValueError, match="must be float16 or bfloat16"):
        dp.comm.compressed_allreduce_hook(torch.float64)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_backward_that_raises_does_not_leave_the_reducer_half_way():
    tracer = dp.Tracer(enabled=True)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    dp.parallelize(model, dp.DDP(bucket_mb=1e-5, first_bucket_mb=1e-5), tracer=tracer)
    buckets = len(strategy_of(model).reducer.buckets)
    x = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="on purpose"):
        model(_FailingBackward.apply(x)).sum().backward()  # fails after every parameter's grad
    model.zero_grad()
    tracer.clear()
    model(x.detach()).sum().backward()
    launches = [e for e in tracer.events if e.name == "bucket_launch"]
    assert buckets > 1 and len(launches) == buckets
    assert tracer.first("reduce_end") is not None

"""DDP across real ranks: parity with single-process training and with PyTorch's DDP."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.api import strategy_of

from .harness import RankError, run_world
from .models import (
    accumulate,
    OPTIMIZERS,
    batch,
    build,
    loss_fn,
    max_param_diff,
    reference_loss,
)

STEPS = 10
PER_RANK = 4
TOL = 1e-5  # max |ours - reference| over every parameter element


def train_against_reference(world, model_name, opt_name, policy, accum=1):
    """Train `policy` on `model_name` and a single-process reference; return the max diff."""
    rank, n = world.rank, world.world_size
    model = build(model_name, seed=100 + rank)  # ranks start different: the wrap broadcasts
    reference = build(model_name, seed=100)  # rank 0's initial weights
    dp.parallelize(model, policy)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = dp.build_optimizer(model, cls, **kwargs)
    ref_opt = cls([p for p in reference.parameters() if p.requires_grad], **kwargs)
    for step in range(STEPS):
        x, y = batch(model_name, step, PER_RANK * n * accum)
        # reference: one step on the whole global batch
        reference_loss(model_name, reference, x, y, step, n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # ours: this rank's chunk, in `accum` micro-batches, the last one synchronised
        xs, ys = x.chunk(n)[rank].chunk(accum), y.chunk(n)[rank].chunk(accum)
        accumulate(model, lambda m: loss_fn(model_name, model, xs[m], ys[m], step, rank), accum)
        opt.step()
        opt.zero_grad()
    return max_param_diff(model, reference)


def parity_grid(world):
    small_buckets = dp.DDP(bucket_mb=0.004, first_bucket_mb=0.001)  # many buckets
    out = {}
    for model_name in ("mlp", "transformer", "tied", "branchy", "odd"):
        for opt_name in ("sgd", "adamw"):
            out[model_name, opt_name] = train_against_reference(
                world, model_name, opt_name, small_buckets
            )
    out["transformer", "adamw", "one-bucket"] = train_against_reference(
        world, "transformer", "adamw", dp.DDP()
    )
    out["branchy", "adamw", "no_sync x3"] = train_against_reference(
        world, "branchy", "adamw", small_buckets, accum=3
    )
    out["mlp", "sgd", "no_sync x3"] = train_against_reference(
        world, "mlp", "sgd", small_buckets, accum=3
    )
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_equals_single_process_on_global_batch(world_size):
    results = run_world(world_size, parity_grid)
    for rank_result in results:
        assert len(rank_result) == 5 * 2 + 3, rank_result  # 5 models x 2 optimizers, 3 more
        for case, diff in rank_result.items():
            assert diff < TOL, f"{case}: max |ddp - reference| = {diff:.3g}"


def against_torch_ddp(world):
    out = {}
    for model_name in ("mlp", "transformer", "tied"):
        for opt_name in ("sgd", "adamw"):
            ours = build(model_name, seed=7)
            theirs = torch.nn.parallel.DistributedDataParallel(build(model_name, seed=7))
            dp.parallelize(ours, dp.DDP(bucket_mb=0.01))
            cls, kwargs = OPTIMIZERS[opt_name]
            opt = dp.build_optimizer(ours, cls, **kwargs)
            their_opt = cls(theirs.parameters(), **kwargs)
            for step in range(STEPS):
                x, y = batch(model_name, step, PER_RANK * world.world_size)
                x, y = x.chunk(world.world_size)[world.rank], y.chunk(world.world_size)[world.rank]
                for model, optimizer in ((ours, opt), (theirs, their_opt)):
                    loss_fn(model_name, model, x, y, step, world.rank).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            out[model_name, opt_name] = max_param_diff(ours, theirs.module)
    return out


def test_parity_with_torch_ddp():
    for rank_result in run_world(2, against_torch_ddp):
        assert len(rank_result) == 3 * 2, rank_result  # 3 models x 2 optimizers
        for case, diff in rank_result.items():
            assert diff < TOL, f"{case}: max |ours - torch DDP| = {diff:.3g}"


class UsedInReverse(nn.Module):
    """Registered in the reverse of the order forward uses its layers."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


def behaviours(world):
    """Sub-cases that each check one promise of the DDP contract."""
    out = {}
    rank, n = world.rank, world.world_size

    # Overlap: bucket 0's all-reduce starts before autograd has produced the last gradient.
    tracer = dp.Tracer(enabled=True)
    policy = dp.DDP(bucket_mb=0.01, first_bucket_mb=0.01)
    model = dp.parallelize(build("transformer", 0), policy, tracer=tracer)
    x, y = batch("transformer", 0, 4)
    loss_fn("transformer", model, x, y, 0, rank).backward()
    launch = tracer.first("bucket_launch", bucket=0).t_ns
    grads = [e.t_ns for e in tracer.events if e.name == "grad_ready"]
    out["overlap"] = {
        "first_launch_before_last_grad": launch < max(grads),
        "grads_after_first_launch": sum(t > launch for t in grads),
        "backward_end_after_launch": tracer.first("backward_end").t_ns > launch,
        "late_launches": sum(1 for e in tracer.events if e.args.get("late")),
    }

    # Gradients are views into the buckets: no copy per step, across zero_grad(set_to_none).
    strategy = strategy_of(model)
    opt = dp.build_optimizer(model, torch.optim.SGD, lr=0.1)
    opt.step()
    opt.zero_grad()
    loss_fn("transformer", model, x, y, 1, rank).backward()
    buffers = [
        (b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.nbytes)
        for b in strategy.reducer.buckets
    ]
    out["grads_are_views"] = all(
        any(lo <= p.grad.data_ptr() < hi for lo, hi in buffers) for p in model.parameters()
    )

    # Sum instead of mean.
    summed = dp.parallelize(nn.Linear(3, 1, bias=False), dp.DDP(reduce_op="sum"))
    summed(torch.full((1, 3), float(rank + 1))).sum().backward()
    out["sum_grad"] = summed.weight.grad.tolist()

    # Compressed hooks stay close to the exact mean.
    for name, hook in (
        ("bf16", dp.comm.bf16_compress_hook),
        ("fp16", dp.comm.fp16_compress_hook),
    ):
        exact = dp.parallelize(build("mlp", 3), dp.DDP())
        compressed = dp.parallelize(build("mlp", 3), dp.DDP(comm_hook=hook))
        x, y = batch("mlp", 5, 4 * n)
        for m in (exact, compressed):
            loss_fn("mlp", m, x.chunk(n)[rank], y.chunk(n)[rank], 0, rank).backward()
        rel = max(
            ((a.grad - b.grad).norm() / a.grad.norm()).item()
            for a, b in zip(exact.parameters(), compressed.parameters(), strict=True)
        )
        out[f"{name}_hook_rel_error"] = rel

    # Buffers (BatchNorm running stats) follow rank 0 at each training forward.
    bn = dp.parallelize(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), dp.DDP())
    for step in range(3):
        bn(
            torch.randn(8, 4, generator=torch.Generator().manual_seed(rank * 10 + step))
        ).sum().backward()
    bn(torch.zeros(2, 4)).sum().backward()  # the broadcast happens at the start of this forward
    stats = bn[1].running_mean.clone()
    out["bn_running_mean"] = stats.tolist()

    # dp.SyncBatchNorm: statistics over the global batch equal plain BatchNorm on it.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    synced = dp.convert_sync_batchnorm(copy.deepcopy(plain))
    dp.parallelize(synced, dp.DDP())
    g = torch.Generator().manual_seed(42)
    xg = torch.randn(4 * n, 4, generator=g) * 3 + 1
    (plain(xg) ** 2).mean().backward()
    ((synced(xg.chunk(n)[rank]) ** 2).mean()).backward()
    out["syncbn_grad_diff"] = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(plain.parameters(), synced.parameters(), strict=True)
    )
    out["syncbn_stats_diff"] = (plain[1].running_var - synced[1].running_var).abs().max().item()
    # A large mean against a small spread: a one-pass E[x^2] - mean^2 would lose the variance.
    wide = torch.randn(4 * n, 6, generator=g) * 0.5 + 3000
    plain_bn, synced_bn = nn.BatchNorm1d(6), dp.convert_sync_batchnorm(nn.BatchNorm1d(6))
    dp.parallelize(synced_bn, dp.DDP())
    diff = (plain_bn(wide).chunk(n)[rank] - synced_bn(wide.chunk(n)[rank])).abs().max().item()
    out["syncbn_large_mean_diff"] = diff

    # [Note: arrival order]: after the first backward the buckets follow the order the
    # gradients arrived in (here the reverse of registration), and the gradients stay exact.
    torch.manual_seed(0)
    net = UsedInReverse()
    reference = copy.deepcopy(net)
    ddp_net = dp.parallelize(net, dp.DDP(bucket_mb=1e-5, first_bucket_mb=1e-5))
    names = {id(p): name for name, p in net.named_parameters()}
    before = [names[id(b.params[0])] for b in strategy_of(ddp_net).reducer.buckets]
    diffs = []
    for step in range(3):
        xg = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(step))
        ddp_net(xg.chunk(n)[rank]).pow(2).mean().backward()
        reference(xg).pow(2).mean().backward()
        diffs += [
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(net.parameters(), reference.parameters(), strict=True)
        ]
        net.zero_grad(), reference.zero_grad()
    # A user's tensor hook registered after parallelize runs before the reducer's: the
    # gradient is reduced as the hook changed it, for the last of a bucket too.
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        a.register_hook(lambda g: g * 3)
        b.register_hook(lambda g: g * 3)
    xg = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(7))
    ddp_net(xg.chunk(n)[rank]).pow(2).mean().backward()
    reference(xg).pow(2).mean().backward()
    diffs += [
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(net.parameters(), reference.parameters(), strict=True)
    ]
    after = [names[id(b.params[0])] for b in strategy_of(ddp_net).reducer.buckets]
    out["arrival"] = {
        "before": before,
        "after": after,
        "max_grad_diff": max(diffs),
        "diffs": len(diffs),
    }

    # Uneven inputs: rank r has 3 + r batches; join stops everyone at the shortest.
    model = dp.parallelize(nn.Linear(2, 1), dp.DDP())
    seen = 0
    for xb in dp.join([torch.randn(2, 2) for _ in range(3 + rank)]):
        model(xb).sum().backward()
        seen += 1
    out["join_steps"] = seen
    # A rank with no batch at all: nobody trains, nobody waits.
    out["join_empty"] = sum(1 for _ in dp.join([] if rank == 0 else [torch.zeros(1)] * 5))
    return out


def test_ddp_behaviours():
    results = run_world(2, behaviours, timeout=120)
    for out in results:
        overlap = out["overlap"]
        assert overlap["first_launch_before_last_grad"], overlap
        assert overlap["grads_after_first_launch"] > 10, overlap
        assert overlap["backward_end_after_launch"] and overlap["late_launches"] == 0, overlap
        assert out["grads_are_views"]
        assert out["sum_grad"] == [[3.0, 3.0, 3.0]]  # rank 0 gives 1s, rank 1 gives 2s
        assert out["bf16_hook_rel_error"] < 1e-2, out
        assert out["fp16_hook_rel_error"] < 1e-3, out
        assert out["syncbn_grad_diff"] < 1e-5 and out["syncbn_stats_diff"] < 1e-5, out
        assert out["syncbn_large_mean_diff"] < 1e-2, out  # outputs are ~N(0, 1)
        assert out["join_steps"] == 3 and out["join_empty"] == 0
        arrival = out["arrival"]
        assert arrival["before"] == ["first.bias", "first.weight", "last.bias", "last.weight"]
        assert sorted(arrival["after"][:2]) == ["last.bias", "last.weight"], arrival
        assert sorted(arrival["after"][2:]) == ["first.bias", "first.weight"], arrival
        assert arrival["diffs"] == 4 * 4 and arrival["max_grad_diff"] < 1e-6, arrival
    assert results[0]["bn_running_mean"] == results[1]["bn_running_mean"]


def mismatched_models(world):
    width = 8 if world.rank == 0 else 9
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width))
    dp.parallelize(model, "ddp")


def test_different_models_fail_on_every_rank_with_one_error():
    with pytest.raises(RankError) as info:
        run_world(2, mismatched_models, timeout=60)
    assert sorted(info.value.errors) == [0, 1]
    for text in info.value.errors.values():
        assert "parameter '1.weight' differs across ranks" in text
        assert (
            "rank 0 has 1.weight shape [8, 4]" in text
            and "rank 1 has 1.weight shape [9, 4]" in text
        )

"""Streaming DiLoCo on real ranks ([Note: streaming DiLoCo] in averaging/diloco.py): the exactness
anchor (one fragment, no overlap: DiLoCo as written in the paper, here by hand), the staggered
schedule of fragments, overlapped reductions, 4-bit outer gradients on the wire, and a
checkpoint taken while a reduction is in flight."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.averaging import split_fragments

from .harness import run_world
from .regression import build, data

LR, EVERY = 0.1, 4
NESTEROV = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _model_and_opt():
    model = build()
    mesh = dp.init_mesh(1)  # every rank its own replica
    dp.parallelize(model, "ddp", group=mesh.shard_group)
    return model, dp.build_optimizer(model, torch.optim.SGD, lr=LR), mesh


def _inner_step(model, opt, step, rank):
    x, y = data(step, rank)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _by_hand(world, steps):
    """DiLoCo, plainly: every EVERY steps, the outer Nesterov SGD on the mean movement."""
    model, opt, _ = _model_and_opt()
    anchors = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    outer = NESTEROV(anchors)
    for step in range(1, steps + 1):
        _inner_step(model, opt, step, world.rank)
        if step % EVERY == 0:
            with torch.no_grad():
                for anchor, p in zip(anchors, model.parameters(), strict=True):
                    anchor.grad = (anchor.detach() - p).div_(world.world_size)
                    dist.all_reduce(anchor.grad)
                outer.step()
                outer.zero_grad()
                for anchor, p in zip(anchors, model.parameters(), strict=True):
                    p.copy_(anchor.detach())
    return _params(model)


def _streamed(world, steps, trace=False, finish=False, **kwargs):
    """Our DiLoCo; with `trace`, after each step: per fragment, the largest difference between
    the replicas' values; with `finish`, `averager.finish()` after the last step (traced as a
    step of its own, with what it returned and the bytes it put on the wire)."""
    model, opt, mesh = _model_and_opt()
    averager = dp.DiLoCo(
        model, opt, EVERY, group=mesh.replicate_group, outer_optimizer=kwargs.pop("outer", None),
        **kwargs,
    )  # fmt: skip
    spread = []

    def trace_spread():
        everyone = world_gather([p.detach().clone() for p in averager.tensors])
        spread.append(
            [
                max((everyone[0][i] - everyone[1][i]).abs().max().item() for i in part)
                for part in averager.parts
            ]
        )

    for step in range(1, steps + 1):
        _inner_step(model, opt, step, world.rank)
        averager.step()
        if trace:
            trace_spread()
    if finish:
        before = averager.wire_bytes()
        finished = [averager.finish(), averager.wire_bytes() - before, averager.finish()]
        trace_spread()
        spread[-1] += finished
    return _params(model), spread, averager.wire_bytes()


def world_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _anchor_and_schedule(world):
    steps = 3 * EVERY
    exact = max(
        (a - b).abs().max().item()
        for a, b in zip(_by_hand(world, steps), _streamed(world, steps)[0], strict=True)
    )
    plain = partial(torch.optim.SGD, lr=1.0)  # outer step = the replicas' mean
    _, staggered, _ = _streamed(world, steps, trace=True, fragments=2, outer=plain)
    _, overlapped, _ = _streamed(world, steps, trace=True, fragments=2, overlap=1, mix=0.0)
    _, warmed, _ = _streamed(world, steps, trace=True, warmup=3, outer=plain)
    # the recipe's pieces: a 4-bit warm-up, an overlapped fragment in flight at the end
    _, recipe, _ = _streamed(
        world, steps, trace=True, finish=True, fragments=2, overlap=1, warmup=2,
        compress="int4",
    )  # fmt: skip
    return exact, staggered, overlapped, warmed, recipe


def test_one_fragment_is_diloco_and_fragments_take_turns():
    exact, staggered, overlapped, warmed, recipe = run_world(2, _anchor_and_schedule, timeout=300)[
        0
    ]
    assert exact == 0.0  # F = 1, tau = 0: DiLoCo, bit for bit
    for step, (first, second) in enumerate(staggered, start=1):
        # fragment 0 at steps 4, 8, 12; fragment 1 staggered by EVERY / 2: at 2, 6, 10
        assert (first == 0.0) == (step % EVERY == 0), (step, first)
        assert (second == 0.0) == (step % EVERY == EVERY // 2), (step, second)
    for step, (first, second) in enumerate(overlapped, start=1):
        # started as above, applied one inner step later (mix 0: the outer result alone)
        assert (first == 0.0) == (step % EVERY == 1 and step > 1), (step, first)
        assert (second == 0.0) == (step % EVERY == EVERY // 2 + 1), (step, second)
    for step, (spread,) in enumerate(warmed, start=1):
        # averaged after each of the 3 warm-up steps, then every EVERY steps counted from them
        assert (spread == 0.0) == (step <= 3 or (step - 3) % EVERY == 0), (step, spread)
    # The recipe: the 4-bit warm-up averages one fragment a step, in turn (fragment 0 after
    # step 1, fragment 1 after step 2), the other apart by its inner step
    assert recipe[0][0] == 0.0 < recipe[0][1] and recipe[1][1] == 0.0 < recipe[1][0]
    assert all(max(s) > 0 for s in recipe[2:-1])  # mix 0.5 keeps the local values in part
    *spread, finished, sent, again = recipe[-1]
    # after step 12 fragment 1's reduction (started at 12) is in flight: finish applies it,
    # then averages every fragment in 4 bits: one model from then on, and once only
    assert spread == [0.0, 0.0] and finished is True and again is False
    # on the wire: the pending reduction's all-gather (its row of P1 entries), then the
    # average's all-to-all and all-gather of the whole model (P entries each), half a byte
    # an entry and a fp32 scale per 1024 (fp32 would send 4 x 5,768 bytes)
    sizes = [p.numel() for p in build().parameters()]

    def row(n: int) -> int:  # a rank's chunk of n entries, padded to whole blocks
        return math.ceil(math.ceil(n / 2) / 1024) * 1024

    second = sum(sizes[i] for i in split_fragments(sizes, 2)[1])
    assert sent == (row(second) + 2 * row(sum(sizes))) * (0.5 + 4 / 1024) == 4644


def _wire_and_resume(world):
    steps = 3 * EVERY
    fp32, _, fp32_bytes = _streamed(world, steps, fragments=2)
    int4, _, int4_bytes = _streamed(world, steps, fragments=2, compress="int4")
    gap = max((a - b).abs().max().item() for a, b in zip(fp32, int4, strict=True))
    # A checkpoint after step 6, while fragment 1's reduction (started at 6) is in flight.
    kwargs = {"fragments": 2, "overlap": 1, "compress": "int8"}
    whole = _streamed(world, steps, **kwargs)[0]
    model, opt, mesh = _model_and_opt()
    averager = dp.DiLoCo(model, opt, EVERY, group=mesh.replicate_group, **kwargs)
    for step in range(1, 7):
        _inner_step(model, opt, step, world.rank)
        averager.step()
    saved = (
        dp.full_state_dict(model),
        dp.optimizer_state_dict(model, opt),
        averager.state_dict(),
    )
    model, opt, mesh = _model_and_opt()
    averager = dp.DiLoCo(model, opt, EVERY, group=mesh.replicate_group, **kwargs)
    dp.load_full_state_dict(model, saved[0])
    dp.load_optimizer_state_dict(model, opt, saved[1])
    averager.load_state_dict(saved[2])
    for step in range(7, steps + 1):
        _inner_step(model, opt, step, world.rank)
        averager.step()
    resumed = max((a - b).abs().max().item() for a, b in zip(whole, _params(model), strict=True))
    return fp32_bytes, int4_bytes, gap, resumed


def test_int4_outer_gradients_and_a_checkpoint_in_flight():
    fp32_bytes, int4_bytes, gap, resumed = run_world(2, _wire_and_resume, timeout=300)[0]
    numel = sum(p.numel() for p in build().parameters())
    # fp32: the start's broadcast (k-1)/k 4n, then 3 outer steps of each fragment: a ring
    # all-reduce of 4 n_f bytes, 2 (k-1)/k 4 n_f = 4 n_f at k = 2, so 4n per round.
    assert fp32_bytes == 2 * numel + 3 * 4 * numel
    # int4: per fragment of n_f entries, each rank's chunk ceil(n_f / 2) padded to blocks of
    # 1024 (P entries), half a byte each + a fp32 scale per block; its all-to-all puts half of
    # 2 rows on the wire, its all-gather its own row: 2 P (1/2 + 4/1024) bytes.
    sizes = [p.numel() for p in build().parameters()]
    chunks = [math.ceil(sum(sizes[i] for i in part) / 2) for part in split_fragments(sizes, 2)]
    padded = [math.ceil(c / 1024) * 1024 for c in chunks]
    assert int4_bytes - 2 * numel == 3 * sum(2 * p * (0.5 + 4 / 1024) for p in padded)
    assert 3 * 4 * numel / (int4_bytes - 2 * numel) > 5  # 8x on large fragments (no padding)
    assert 0 < gap < 0.05  # error feedback keeps int4 close to fp32
    assert resumed == 0.0  # the pending reduction was kept and applied when due

"""The worker side of live recovery without processes: which errors are a lost peer, and the
rewind of an interrupted step ([Note: live recovery] in train/live/recovery.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from dataparallel.data.stream import SampleStream
from dataparallel.train.ledger import Ledger
from dataparallel.train.live.recovery import lost_peer
from dataparallel.train.live.rewind import Mark


def test_only_the_backends_failures_are_a_lost_peer():
    closed = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    timed_out = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting"
    assert lost_peer(RuntimeError(closed)) and lost_peer(RuntimeError(timed_out))
    assert lost_peer(dist.DistBackendError("NCCL communicator was aborted"))
    assert not lost_peer(RuntimeError("The size of tensor a (36864) must match the size of b"))
    assert not lost_peer(ValueError("gloo"))  # not a RuntimeError: the program's own fault


def test_a_rewound_step_puts_its_samples_back_and_drops_its_gradients():
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    samples = SampleStream(100, seed=1, consumed=24)
    ledger = Ledger(samples=samples, step=2)
    state = SimpleNamespace(ledger=ledger, optimizer=optimizer, gradients=None, model=layer)
    mark = Mark.of(state)
    samples.take_share(12, 0, 3)  # the interrupted step took its share...
    layer(torch.ones(1, 3)).sum().backward()  # ...and computed part of a gradient
    assert samples.consumed == 36 and layer.weight.grad is not None
    mark.rewind(state)
    assert samples.consumed == 24 and layer.weight.grad is None


def test_the_redone_step_reads_the_same_samples_over_fewer_ranks():
    def step_over(ranks: int) -> list[int]:
        shares = []
        for rank in range(ranks):  # each rank's own stream, at the step's start
            shares += SampleStream(100, seed=1, consumed=24).take_share(12, rank, ranks)
        return sorted(shares)

    assert step_over(2) == step_over(3) and len(set(step_over(3))) == 12


def _diloco_replica():
    """A world of one's replica under DiLoCo every 3 steps (Nesterov momentum outside, AdamW
    inside): the TrainState fields that a WindowMark copies."""
    import dataparallel as dp

    dp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    recipe = dp.Recipe(
        strategy="ddp", diloco=3, outer_compress="fp32", fragments=1, overlap=0, outer_warmup=0
    )
    composed = dp.compose(model, recipe, torch.optim.AdamW, lr=1e-2)
    return SimpleNamespace(
        model=composed.model, optimizer=composed.optimizer, averager=composed.averager,
        ledger=Ledger(samples=SampleStream(1000, seed=1)), gradients=None,
    )  # fmt: skip


def _steps(state, count: int) -> None:
    for _ in range(count):
        x = torch.randn(5, 4)
        state.model(x).square().mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.averager.step()
        state.ledger.samples.take_share(5, 0, 1)
        state.ledger.step += 1


def test_a_window_mark_brings_a_diloco_replica_back_bit_for_bit():
    """[Note: live averaging]: the steps redone from a WindowMark give what they gave the first
    time: parameters, inner and outer optimizer state and anchors all went back."""
    from dataparallel.train.live.rewind import WindowMark

    state = _diloco_replica()
    _steps(state, 3)  # an outer step at 3: a boundary
    assert state.averager.at_boundary()
    mark = WindowMark.of(state)
    _steps(state, 5)  # past the next boundary (6), into the window after it
    first = [p.detach().clone() for p in state.model.parameters()]
    moment = [v.clone() for v in state.averager.outer.state_dict()["state"][0].values()]
    assert not state.averager.at_boundary()
    mark.rewind(state)
    assert (state.ledger.step, state.averager.steps, state.ledger.samples.consumed) == (3, 3, 15)
    _steps(state, 5)
    again = list(state.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    again_moment = list(state.averager.outer.state_dict()["state"][0].values())
    assert all(torch.equal(a, b) for a, b in zip(moment, again_moment, strict=True))


def test_a_healed_diloco_replica_starts_from_the_anchors():
    """A replica healed at a boundary takes the shared state and starts from the anchors, not
    from the source's own progress ([Note: live averaging])."""
    state = _diloco_replica()
    _steps(state, 4)  # one step past the boundary at 3: the parameters moved off the anchors
    shared = state.averager.shared()
    anchors = [a.detach().clone() for a in state.averager.anchors]
    assert not all(
        torch.equal(p, a) for p, a in zip(state.model.parameters(), anchors, strict=True)
    )
    state.averager.adopt(shared)
    params = list(state.model.parameters())
    assert all(torch.equal(p, a) for p, a in zip(params, anchors, strict=True))
    assert state.averager.steps == 4 and state.averager.pending is None


def test_a_rewound_step_puts_the_compression_state_back():
    """Under --compress the mark copies the hook's state; the rewind restores it (the
    residuals, top-k's velocity and the rounds the interrupted step had moved)."""
    from dataparallel.comm.hooks import HookState
    from dataparallel.compression import build_hook
    from dataparallel.compression.live import StepCopy

    hook = build_hook("topk:ratio=0.25,momentum=0.9")
    comm = HookState(SimpleNamespace(world_size=1, rank=0))

    def reduce(value: float) -> None:
        bucket = SimpleNamespace(index=0, buffer=torch.arange(8.0) * value, shard=None, shapes=[])
        hook(comm, bucket).wait()

    reduce(1.0)  # step 1: entries 6 and 7 sent, 0..5 held back
    layer = torch.nn.Linear(3, 2)
    state = SimpleNamespace(
        ledger=Ledger(samples=SampleStream(100, seed=1, consumed=12), step=1),
        optimizer=torch.optim.SGD(layer.parameters(), lr=0.1), gradients=None, model=layer,
    )  # fmt: skip
    mark = Mark.of(state, StepCopy(hook))
    reduce(-3.0)  # the interrupted step 2
    assert hook.rounds == 2
    mark.rewind(state)
    assert hook.rounds == 1
    residual = hook.compressor.feedback.residuals[(0, "all")]
    assert residual.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0]
    assert hook.compressor.velocity[(0, "all")].tolist() == residual.tolist()

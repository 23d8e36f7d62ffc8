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

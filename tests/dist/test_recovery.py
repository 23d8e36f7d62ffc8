"""The rewind and the heal of a DiLoCo replica in a world of one (a real process group of one
rank: the averager's collectives); the pure logic of live recovery's worker side is
tests/unit/test_recovery.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dataparallel.data.stream import SampleStream
from dataparallel.train.ledger import Ledger


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

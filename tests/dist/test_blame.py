"""[Note: blame] on 3 real ranks: a rank that sleeps in every step is named a straggler, and a
rank whose loss, or only whose gradients, are not finite is named when the step is skipped.

All three cases run in one spawned world (train/blame.py, train/gradient_watch.py).
"""

from __future__ import annotations

import time

import torch

from .harness import run_world
from .tiny_trainer import trainer_state

SLEEP_S = 0.15  # gpt-tiny's step here: 10-100 ms (3 ranks on 2 busy cores)


def _fit(state, steps: int):
    """fit() for `steps` steps with rank 0's Blame callback; (warnings, records, error)."""
    from dataparallel.train.blame import Blame, StragglerRule
    from dataparallel.train.loop import Callback, fit

    warnings, records = [], []

    class Keep(Callback):
        def on_step(self, state, record):
            records.append(record)

    callbacks = [Keep()]
    if state.world.rank == 0:
        callbacks.append(Blame(StragglerRule(window=6, slower_by=0.5), write=warnings.append))
    state.config = state.config.replace(train={"stop_after": steps, "eval_every": 0})
    try:
        fit(state, callbacks)
        error = ""
    except FloatingPointError as failure:
        error = str(failure)
    return warnings, records, error


def blame_cases(world) -> dict:
    out = {}
    # A straggler: rank 2 sleeps while reading each micro-batch.
    state = trainer_state(world, "ddp", global_batch=12, accum=1)
    if world.rank == 2:
        batch = state.train_windows.batch
        state.train_windows.batch = lambda indices: (time.sleep(SLEEP_S), batch(indices))[1]
    warnings, records, _ = _fit(state, 8)
    out["straggler"] = (warnings, [list(r.rank_step_s) for r in records])
    # A non-finite loss on rank 1 (its logits times nan).
    state = trainer_state(world, "ddp", global_batch=12, accum=1)
    state.config = state.config.replace(train={"max_skips": 2})
    if world.rank == 1:
        forward = state.model.forward
        state.model.forward = lambda x: forward(x) * float("nan")
    out["loss"] = _fit(state, 4)[::2]
    # Finite losses, but an infinite gradient on rank 2 (made before the watch sees it).
    state = trainer_state(world, "zero2", global_batch=12, accum=2)
    state.config = state.config.replace(train={"max_skips": 2})
    if world.rank == 2:
        from dataparallel.train.gradient_watch import GradientWatch

        state.gradients.remove()
        next(state.model.parameters()).register_hook(lambda g: g * float("inf"))
        state.gradients = GradientWatch(state.model)
    out["gradient"] = _fit(state, 4)[::2]
    return out


def test_the_slow_rank_and_the_non_finite_ranks_are_named():
    results = run_world(3, blame_cases)
    warnings, times = results[0]["straggler"]
    assert len(times) == 8 and all(len(t) == 3 for t in times)
    # Rank 2's work time includes its sleep; the others' leaves out their wait for it.
    assert all(t[2] > SLEEP_S for t in times), times
    median = [sorted(column)[len(column) // 2] for column in zip(*times, strict=True)]
    assert median[2] > 1.5 * max(median[0], median[1]), times
    assert max(median[0], median[1]) < SLEEP_S, times
    print(f"\nmedian work times {[round(m, 3) for m in median]}\n{warnings}")
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("dataparallel train: warning: rank 2 is a straggler: ")
    assert "over the last 6 steps (at step " in warnings[0]
    for case, rank in (("loss", 1), ("gradient", 2)):
        warnings, error = results[0][case]
        assert [w.split(": ", 2)[2] for w in warnings] == [
            f"step 1 skipped: the loss or gradient of rank {rank} was not finite before the "
            f"reduction ({n} in a row, --max-skips 2)"
            for n in (1, 2)
        ], warnings
        for r in results:  # every rank stops with the same line
            assert f"before the reduction it was not finite on rank(s) {rank};" in r[case][1]
            assert r[case][1].startswith("2 steps in a row after step 0 had a non-finite")

"""The training loop in a world of one: loss normalisation, accumulation, bf16, evaluation.

Multi-rank behaviour (2 workers) is covered end to end in tests/e2e/test_train_cli.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.data.corpus import Corpus, evenly_spaced
from dataparallel.data.stream import SampleStream
from dataparallel.train.config import RunConfig
from dataparallel.train.trainer import evaluate, next_indices, setup, train_step

TEXT = (b"def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 40)[:1500]


@pytest.fixture
def world():
    world = dp.init()
    yield world
    dp.destroy()


def _corpus() -> Corpus:
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    return Corpus(tokens=tokens, num_files=1, sha256="test", source="test")


def _config(**train) -> RunConfig:
    return RunConfig().replace(
        data={"block_size": 16, "eval_windows": 5, "val_fraction": 0.2},
        train={"steps": 4, "seed": 3, **train},
        optim={"warmup_steps": 0},
        launch={"nproc": 1},
    )


def _run(steps: int, **train) -> tuple[list[float], dict]:
    """Train `steps` steps in a fresh world of one; the losses and the final weights."""
    world = dp.init()
    try:
        state = setup(_config(**train), world, _corpus())
        losses = [train_step(state).loss for _ in range(steps)]
        return losses, {k: v.clone() for k, v in state.model.state_dict().items()}
    finally:
        dp.destroy()


def test_accumulation_gives_the_losses_and_weights_of_the_whole_batch():
    whole, whole_weights = _run(3, batch=6, accum=1)
    split, split_weights = _run(3, batch=2, accum=3)
    assert split == pytest.approx(whole, rel=1e-6)
    # Adam divides by sqrt(v): where a gradient is ~0, a rounding difference (sums taken in
    # another order) moves the update by a visible fraction of lr = 2e-3; 1e-5 is 0.5% of it.
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, rtol=1e-4, atol=1e-5)


def _step_beside_a_copy(state, count: int):
    """A copy of the model before one train step, the step's record, and the `count` windows
    the step trained on (the sample stream wound back to read them again)."""
    start = dict(state.ledger.samples.state_dict())
    model = type(state.model)(state.model.config)
    model.load_state_dict(state.model.state_dict())
    record = train_step(state)
    state.ledger.samples.load_state_dict(start)
    inputs, targets = state.train_windows.batch(next_indices(state, count))
    return model, record, inputs, targets


def test_the_step_loss_is_the_mean_token_loss_of_the_batch(world):
    state = setup(_config(batch=3, accum=2), world, _corpus())
    model, record, inputs, targets = _step_beside_a_copy(state, 6)
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert record.loss == pytest.approx(float(expected), rel=1e-6)
    assert record.tokens == 6 * 16 and record.step == 1


def test_bf16_autocast_trains_close_to_fp32():
    fp32, _ = _run(2, batch=4)
    bf16, _ = _run(2, batch=4, precision="bf16")
    assert bf16 == pytest.approx(fp32, abs=0.05)
    assert bf16 != fp32


def test_evaluation_scores_the_chosen_windows_exactly(world):
    state = setup(_config(batch=2), world, _corpus())
    record = evaluate(state)
    chosen = evenly_spaced(5, len(state.val_windows))
    inputs, targets = state.val_windows.batch(chosen)
    with torch.no_grad():
        expected = F.cross_entropy(state.model(inputs).flatten(0, 1), targets.flatten())
    assert record.val_loss == pytest.approx(float(expected), rel=1e-6)
    assert record.tokens == 5 * 16
    assert state.model.training


def test_indices_run_on_into_the_next_epoch(world):
    state = setup(_config(batch=2), world, _corpus())
    state.ledger.samples = SampleStream(5, seed=0)
    first, second = next_indices(state, 4), next_indices(state, 4)
    assert sorted(first + second[:1]) == [0, 1, 2, 3, 4]
    assert (state.ledger.samples.epoch, state.ledger.samples.consumed) == (1, 8)


class _Poisoned(torch.nn.Module):
    """A model whose logits are NaN while `poisoned` is set (a numerical fault on demand)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.poisoned = inner, False

    def forward(self, x):
        out = self.inner(x)
        return out * float("nan") if self.poisoned else out


def test_non_finite_steps_are_skipped_and_k_in_a_row_stop_the_run(world):
    from dataparallel.models import build_model
    from dataparallel.train.loop import fit

    torch.manual_seed(3)
    model = _Poisoned(build_model("gpt-tiny"))
    state = setup(_config(batch=2, max_skips=3, steps=20, eval_every=0), world, _corpus(), model)
    train_step(state)
    weights = {k: v.clone() for k, v in dp.full_state_dict(state.model).items()}
    model.poisoned = True
    records = [train_step(state) for _ in range(2)]
    assert (state.step, state.ledger.skipped_steps, state.ledger.consecutive_skips) == (1, 2, 2)
    assert [r.skipped_steps for r in records] == [1, 2]
    after = dp.full_state_dict(state.model)
    assert all(torch.equal(after[k], weights[k]) for k in weights)  # nothing moved
    model.poisoned = False
    train_step(state)  # a good step resets the count, and trains
    assert (state.step, state.ledger.consecutive_skips) == (2, 0)
    model.poisoned = True
    with pytest.raises(FloatingPointError, match="3 steps in a row after step 2"):
        fit(state, [])


def test_an_overflowing_fp16_step_is_skipped_without_moving_anything(world):
    state = setup(_config(batch=2, precision="fp16"), world, _corpus())
    assert state.scaler is not None and state.scaler.get_scale() == 2.0**16
    state.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # fp16 overflows at once
    weights = {k: v.clone() for k, v in dp.full_state_dict(state.model).items()}
    record = train_step(state)
    assert (state.step, state.ledger.skipped_steps, record.skipped_steps) == (0, 1, 1)
    assert record.loss_scale == 2.0**39
    # No step was taken: the fused AdamW ([Note: the job's AdamW kernel]) is stepped with the
    # scaler's found-inf and makes its state, but counts no step and moves no moment.
    assert state.optimizer.state  # the fused kernel made it (not vacuous below)
    moments = [v for s in state.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert all(float(s["step"]) == 0.0 for s in state.optimizer.state.values())
    assert all(not v.any() for v in moments) and len(moments) == 2 * len(state.optimizer.state)
    after = dp.full_state_dict(state.model)
    assert all(torch.equal(after[k], v) for k, v in weights.items())
    for _ in range(40):  # the scale backs off until the steps are finite
        if train_step(state).step == 1:
            break
    assert state.step == 1 and 0 < state.scaler.get_scale() <= 2.0**16  # halved each skip


def test_bf16_parameters_train_close_to_fp32():
    fp32, _ = _run(2, batch=4)
    bf16, weights = _run(2, batch=4, precision="bf16-params")
    assert bf16 == pytest.approx(fp32, abs=0.05)
    assert bf16 != fp32
    assert weights["head.weight"].dtype == torch.bfloat16  # the model computes in bf16


def _masked_config(tmp_path, **train) -> RunConfig:
    """Prompt/completion data: each window holds a different number of completion tokens."""
    import json

    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        records = [
            {"prompt": f"{i} times {'x' * (i % 9)} =", "completion": f" {'y' * (i % 5)}{i}\n"}
            for i in range(120)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return _config(**train).replace(data={"paths": (str(path),)})


def test_masked_targets_are_neither_summed_nor_counted(world, tmp_path):
    from dataparallel.data.packing import IGNORE

    state = setup(_masked_config(tmp_path, batch=3, accum=2), world)
    model, record, inputs, targets = _step_beside_a_copy(state, 6)
    counted = int((targets != IGNORE).sum())
    assert 0 < counted < 6 * 16 and record.tokens == counted
    with torch.no_grad():
        logits = model(inputs).flatten(0, 1)
        expected = F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE)
    assert record.loss == pytest.approx(float(expected), rel=1e-6)
    evaluation = evaluate(state)
    _, val_targets = state.val_windows.batch(evenly_spaced(5, len(state.val_windows)))
    assert evaluation.tokens == int((val_targets != IGNORE).sum()) < val_targets.numel()


def test_masked_accumulation_gives_the_losses_of_the_whole_batch(tmp_path):
    runs = []
    for batch, accum in [(6, 1), (2, 3)]:
        world = dp.init()
        try:
            state = setup(_masked_config(tmp_path, batch=batch, accum=accum), world)
            runs.append([train_step(state).loss for _ in range(3)])
        finally:
            dp.destroy()
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)  # [Note: loss normalisation]

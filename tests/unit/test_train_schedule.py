"""The learning-rate schedule: linear scaling, warm-up, cosine decay."""

from __future__ import annotations

import math

import pytest

from dataparallel.train.lr_schedule import WarmupCosine, scaled_lr


def test_linear_scaling_multiplies_by_the_batch_ratio():
    assert scaled_lr(1e-3, 128, scaling="linear", base_batch=32) == pytest.approx(4e-3)
    assert scaled_lr(1e-3, 128, scaling="none", base_batch=32) == 1e-3
    with pytest.raises(ValueError, match="'sqrt'"):
        scaled_lr(1e-3, 128, scaling="sqrt", base_batch=32)


def test_warmup_then_cosine_to_the_floor():
    schedule = WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    factors = [schedule(step) for step in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0  # the first step after warm-up is at the peak
    # Halfway through the decay (step 4 + 9/2) the cosine is at the middle of peak and floor.
    halfway = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9))
    assert factors[8] == pytest.approx(halfway)
    assert factors[13] == pytest.approx(0.1)  # the last update is at the floor
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert schedule(100) == pytest.approx(0.1)


def test_warmup_longer_than_the_run_never_reaches_the_peak():
    schedule = WarmupCosine(warmup_steps=30, total_steps=10)
    assert [schedule(s) for s in (0, 9)] == [pytest.approx(1 / 30), pytest.approx(10 / 30)]


def test_no_warmup_starts_at_the_peak():
    assert WarmupCosine(warmup_steps=0, total_steps=5, min_ratio=0.0)(0) == 1.0
    with pytest.raises(ValueError, match="min_ratio=2"):
        WarmupCosine(warmup_steps=0, total_steps=5, min_ratio=2)

"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def live_reference(tmp_path_factory) -> Path:
    """The uninterrupted run that the live runs of test_live_recovery and test_elastic must
    match: LIVE_ARGS on one rank with the whole global batch of 12 windows (trained once)."""
    from .helpers import LIVE_ARGS, train

    out = tmp_path_factory.mktemp("live_reference") / "run"
    result = train([*LIVE_ARGS, "--nproc", "1", "--batch", "12"], out)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return out

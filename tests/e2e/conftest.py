"""Fixtures shared by the end-to-end tests: runs that several test modules read, trained once
per session. A test that changes such a run works on a copy."""

from __future__ import annotations

import subprocess
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


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """REFERENCE_ARGS uninterrupted (2 workers, DDP, 12 steps, checkpoints at 6 and 12): the
    stored curve's run (test_train_cli) and the run the faults must end on (test_faults)."""
    from .helpers import REFERENCE_ARGS, ok, train

    out = tmp_path_factory.mktemp("reference") / "run"
    result = train(REFERENCE_ARGS, out)
    ok(result)
    return out, result


@pytest.fixture(scope="session")
def six_steps(tmp_path_factory):
    """The reference run under a strategy, stopped after 6 steps: trained once per strategy and
    shared (ZeRO-3's by the strategies' curve and by the int8 test's exact bytes in
    test_train_cli; ZeRO-2's is the checkpoint test_faults resumes and damages, on copies)."""
    from .helpers import REFERENCE_ARGS, ok, train

    runs: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"six_steps_{strategy}") / "run"
            ok(train([*REFERENCE_ARGS, "--strategy", strategy, "--stop-after", "6"], out))
            runs[strategy] = out
        return runs[strategy]

    return run


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """hf_fixtures.make_tiny_llama with its defaults (2 layers, width 32, seed 0; the BPE
    tokenizer in the same folder), built once for the e2e modules that only read it (a test
    that changes a file copies the folder first)."""
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "llama")

"""Fixtures shared by the end-to-end tests: runs that several test modules read, trained once
per session. A test that changes such a run works on a copy.

The suite runs in 2 processes (pytest-xdist, `make test`), each with its own session fixtures;
`once` makes such a run once for both: the first to need it trains it under a lock in the
folder the two share, the other waits and reads it."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


def once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `make(folder)` once per test session, whichever of the
    session's processes asks first (a `make` that raises leaves it to be made again)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder = base / f"once-{name}"
    with open(base / f"once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            (folder / ".made").touch()
    return folder


def _train_once(
    tmp_path_factory, name: str, args: list[str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """`train(args)` into once(name)/run, its output kept beside it for the other process:
    (the run's folder, the command's result)."""
    from .helpers import ok, train

    def make(folder: Path) -> None:
        result = train(args, folder / "run")
        ok(result)
        (folder / "stdout.txt").write_text(result.stdout)
        (folder / "stderr.txt").write_text(result.stderr)

    folder = once(tmp_path_factory, name, make)
    stdout, stderr = (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text()
    return folder / "run", subprocess.CompletedProcess(args, 0, stdout, stderr)


@pytest.fixture(scope="session")
def live_reference(tmp_path_factory) -> Path:
    """The uninterrupted run that the live runs of test_live_recovery and test_elastic must
    match: LIVE_ARGS on one rank with the whole global batch of 12 windows (trained once)."""
    from .helpers import LIVE_ARGS

    args = [*LIVE_ARGS, "--nproc", "1", "--batch", "12"]
    return _train_once(tmp_path_factory, "live_reference", args)[0]


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """REFERENCE_ARGS uninterrupted (2 workers, DDP, 12 steps, checkpoints at 6 and 12): the
    stored curve's run (test_train_cli) and the run the faults must end on (test_faults)."""
    from .helpers import REFERENCE_ARGS

    return _train_once(tmp_path_factory, "reference", REFERENCE_ARGS)


@pytest.fixture(scope="session")
def six_steps(tmp_path_factory):
    """The reference run under a strategy, stopped after 6 steps: trained once per strategy and
    shared (ZeRO-3's by the strategies' curve and by the int8 test's exact bytes in
    test_train_cli; ZeRO-2's is the checkpoint test_faults resumes and damages, on copies)."""
    from .helpers import REFERENCE_ARGS

    def run(strategy: str) -> Path:
        args = [*REFERENCE_ARGS, "--strategy", strategy, "--stop-after", "6"]
        return _train_once(tmp_path_factory, f"six_steps_{strategy}", args)[0]

    return run


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """hf_fixtures.make_tiny_llama with its defaults (2 layers, width 32, seed 0; the BPE
    tokenizer in the same folder), built once for the e2e modules that only read it (a test
    that changes a file copies the folder first)."""
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_llama

    folder = once(tmp_path_factory, "tiny_llama", lambda made: make_tiny_llama(made / "llama"))
    return folder / "llama"

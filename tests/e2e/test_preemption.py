"""Preemption, end to end through the CLI: a SIGTERM to the launcher stops every rank after the
same step with that step saved and status 75; the same command with `--resume auto` ends with
the weights of an uninterrupted run, bit for bit; a save cut by the budget (and a second
SIGTERM during it) leaves the previous checkpoint whole ([Note: preemption] in
launch/preemption.py; docs/faults.md, "Preemption").

The 10-trial figure comes from benchmarks/preempt_trials.py; here one trial of each kind runs
(tests/signalled_runs.py, the trial they share).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import signalled_runs
from killed_runs import same_weights

from dataparallel.checkpoint import verify
from dataparallel.launch.preemption import PREEMPTED
from dataparallel.train.preemption import ENV_SLOW_SAVE

from .helpers import CORPUS, REFERENCE_ARGS, cli


# 2 workers, gpt-tiny, 12 steps, a checkpoint every 6; one command for every session.
def _command(out: Path, *extra: str) -> list[str]:
    train = [sys.executable, "-m", "dataparallel.cli", "train", "--data", str(CORPUS)]
    return [*train, *REFERENCE_ARGS, "--out", str(out), "--resume", "auto", *extra]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """A `python -m dataparallel.cli` command run to its end, forked from the warm server (the
    signalled ones start fresh, in signalled_runs.py, which the trial scripts share)."""
    assert args[:3] == [sys.executable, "-m", "dataparallel.cli"], args
    return cli(args[3:], env=signalled_runs.environment())


def _ok(result, code: int = 0):
    assert result.returncode == code, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


@pytest.fixture(scope="module")
def whole(reference_run) -> Path:
    """The uninterrupted run: REFERENCE_ARGS without --resume auto, trained once a session
    (conftest.py). `--resume auto` on an empty --out starts the run in `preempted` below, and
    every resumed session must end on this run's weights bit for bit."""
    return reference_run[0]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> tuple[Path, dict]:
    """The same command, SIGTERM to the launcher once step 3 is recorded."""
    out = tmp_path_factory.mktemp("preempted") / "run"
    when = lambda o: signalled_runs.last_step(o) >= 3  # noqa: E731
    return out, signalled_runs.signal_run(_command(out), out, when, signal.SIGTERM)


def test_sigterm_saves_the_step_every_rank_stopped_after(preempted):
    out, result = preempted
    assert result["code"] == PREEMPTED, result["stderr"]
    stopped = result["stopped_after"]
    assert 3 <= stopped < 12 and result["latest"] == stopped
    latest = out / "checkpoint" / f"step-{stopped:06d}"
    assert verify(latest)["ledger"]["step"] == stopped
    assert json.loads((latest / "train_state.json").read_text())["step"] == stopped
    assert "--resume auto" in result["stdout"]
    assert not (out / "model.safetensors").exists()  # the run is not over


def test_resume_auto_ends_with_the_uninterrupted_weights_bit_for_bit(whole, preempted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(preempted[0], out)
    _ok(_run(_command(out)))
    assert same_weights(out / "model.safetensors", whole / "model.safetensors")
    # Each step once in the metrics, though the first session stopped halfway.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))


def test_a_save_cut_by_the_budget_and_a_second_sigterm_leave_the_previous_checkpoint_whole(
    whole, tmp_path
):
    """Every rank sleeps 60 s inside the preemption save (ENV_SLOW_SAVE); the budget is 3 s; a
    second SIGTERM lands during the save. The launcher kills the workers at the budget and
    exits 75; checkpoint 6 stays the latest and intact, the cut save stays .tmp, and the same
    command resumes from 6 to the uninterrupted weights."""
    out = tmp_path / "run"
    args = _command(out, "--preempt-budget", "3")
    result = signalled_runs.signal_run(
        args,
        out,
        lambda o: signalled_runs.last_step(o) >= 7,
        signal.SIGTERM,
        again_after_s=1.0,
        env={ENV_SLOW_SAVE: "60"},
    )
    assert result["code"] == PREEMPTED, result["stderr"]
    assert result["stopped_after"] is None  # killed inside the save: no rank said it finished
    assert result["exit_s"] < 3 + 10  # the budget, and the launcher's own exit under load
    assert "SIGTERM again" in result["stderr"]
    assert result["latest"] == 6
    assert verify(out / "checkpoint" / "step-000006")["ledger"]["step"] == 6
    cut = list((out / "checkpoint").glob("step-*.tmp"))
    assert len(cut) == 1 and int(cut[0].name[5:11]) > 6
    _ok(_run(args))
    assert same_weights(out / "model.safetensors", whole / "model.safetensors")


def test_resume_auto_refuses_another_global_batch_and_another_model(preempted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(preempted[0], out)
    cases = [
        (["--batch", "2"], "--resume auto: the run in"),
        (["--model", "gpt-small"], "--model (model.name)"),
    ]
    for extra, named in cases:
        result = _run(_command(out, *extra))
        _ok(result, 2)
        assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert len(cases) == 2


def test_resume_auto_needs_the_run_directory():
    train = [sys.executable, "-m", "dataparallel.cli", "train", "--model", "gpt-tiny"]
    result = _run([*train, "--resume", "auto"])
    _ok(result, 2)
    assert "--resume auto: needs the run directory; give --out RUN_DIR" in result.stderr


def test_no_signal_handlers_in_a_subinterpreter(tmp_path):
    """A subinterpreter's first thread is its own `threading.main_thread()`, and Python still
    refuses it a handler: preemption.py (stdlib imports only) loaded there says no. In a fresh
    process of its own: a subinterpreter left the test process's torch unable to run autograd
    ("The autograd engine was called while holding the GIL") in every test after it."""
    answer = tmp_path / "answer"
    inner = f"""
import importlib.util, signal, threading
spec = importlib.util.spec_from_file_location("preemption", {preemption_file()!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
try:
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    refused = False
except ValueError:
    refused = True
main = threading.current_thread() is threading.main_thread()
open({str(answer)!r}, "w").write(repr((module.signals_allowed(), refused, main)))
"""
    outer = f"""
try:
    import _interpreters as interpreters  # CPython 3.13 and later
except ImportError:
    import _xxsubinterpreters as interpreters  # CPython 3.10 to 3.12
interpreter = interpreters.create()
try:
    run = getattr(interpreters, "exec", None) or interpreters.run_string
    run(interpreter, {inner!r})
finally:
    interpreters.destroy(interpreter)
"""
    done = subprocess.run([sys.executable, "-c", outer], capture_output=True, text=True, timeout=60)
    if "No module named '_xxsubinterpreters'" in done.stderr:
        pytest.skip("this Python has no subinterpreters")
    assert done.returncode == 0, done.stderr
    assert answer.read_text() == "(False, True, True)"  # not allowed, refused, its main thread


def preemption_file() -> str:
    from dataparallel.launch import preemption

    return preemption.__file__

"""Workers forked from the launcher (launch/forked.py, [Note: forked workers]): a ForkedProcess
runs a module's main() in the environment it is given, ends with its status, has Popen's verbs,
and undoes what a fresh interpreter would not have inherited. The end-to-end runs (train,
generate, eval, live) are in tests/e2e; test_train_cli checks that their workers were forked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dataparallel.launch.forked import ForkedProcess, forking_works, start_forked

MODULE = """
import json, os, signal, sys, time
import torch

def main():
    what = os.environ["WHAT"]
    if what == "report":
        handlers = {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGUSR1", "SIGINT")}
        report = {"env": os.environ.get("ONLY"), "parent_only": os.environ.get("PARENT_ONLY"),
                  "threads": torch.get_num_threads(), "handlers": handlers,
                  "name": open(f"/proc/{os.getpid()}/comm").read().strip()}
        open(os.environ["OUT"], "w").write(json.dumps(report))
        return 3
    if what == "exit":
        sys.exit(2)
    if what == "raise":
        raise ValueError("a worker's own error")
    time.sleep(60)
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "forked_probe.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "forked_probe"


def env(**given) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", **given}


def test_this_machine_forks():
    assert forking_works() == (sys.platform == "linux" and torch.version.cuda is None)


def test_the_child_has_the_given_environment_fresh_handlers_and_threads_and_its_name(
    module, tmp_path, monkeypatch
):
    import json

    out = tmp_path / "report.json"
    monkeypatch.setenv("PARENT_ONLY", "1")
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)  # the launcher's own handler
    try:
        child = ForkedProcess(
            module, env(WHAT="report", ONLY="x", OUT=str(out), OMP_NUM_THREADS="3"), "dp rank 7"
        )
        assert child.wait(60) == 3 and child.returncode == 3
    finally:
        signal.signal(signal.SIGUSR1, previous)
    report = json.loads(out.read_text())
    assert report["env"] == "x" and report["parent_only"] is None  # `env` is all of it
    assert report["threads"] == 3  # OMP_NUM_THREADS of its environment, not the launcher's
    assert report["handlers"]["SIGUSR1"] == repr(signal.SIG_DFL)
    assert report["handlers"]["SIGINT"] == repr(signal.default_int_handler)
    assert report["name"] == "dp rank 7"


@pytest.mark.parametrize(("what", "code"), [("exit", 2), ("raise", 1)])
def test_the_status_is_the_workers(module, what, code, capfd):
    child = ForkedProcess(module, env(WHAT=what), "dp rank 0")
    assert child.wait(60) == code
    if what == "raise":
        assert "ValueError: a worker's own error" in capfd.readouterr().err


def test_popens_verbs(module):
    child = ForkedProcess(module, env(WHAT="sleep"), "dp slot 1.0")
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/comm").read_text().strip() != "dp slot 1.0":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.terminate()
    assert child.wait(30) == -signal.SIGTERM
    child.kill()  # ended already: nothing to signal
    assert child.poll() == -signal.SIGTERM


def test_only_a_module_is_forked():
    with pytest.raises(ValueError, match="not --module MODULE"):
        start_forked(["--nproc-per-node=2", "script.py", "--flag"])

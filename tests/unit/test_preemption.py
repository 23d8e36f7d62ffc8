"""The signal handlers of preemption, without a run ([Note: preemption] in launch/preemption.py):
the launcher raises torch's SignalException once and says a repeat once; a worker's flag keeps
the first signal; the agent is told to leave SIGTERM and SIGUSR1 to us and to wait the budget;
handlers are installed only on the main thread of the main interpreter ([Note: signals on the
main thread]; a worker off it is Ray's, tests/e2e/test_ray.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from dataparallel.launch import preemption
from dataparallel.launch.config import ConfigError, LaunchConfig, check_launch
from dataparallel.launch.preemption import (
    LauncherSignals,
    WorkerSignals,
    preempting,
    signals_allowed,
)
from dataparallel.launch.workers import (
    AGENT_FIXED_SHUTDOWN_S,
    agent_flags,
    shutdown_timeout,
    torchrun_argv,
)


@pytest.fixture
def kept_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_the_launcher_raises_once_and_says_a_repeat_once(kept_handlers, capsys):
    signals = LauncherSignals(budget_s=25).install()
    with pytest.raises(SignalException) as raised:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert raised.value.sigval == signal.SIGUSR1 and signals.received == signal.SIGUSR1
    assert preempting(os.getpid()).exists()  # marked before the agent passes it on
    for _ in range(3):  # later signals: no exception, one line in all
        os.kill(os.getpid(), signal.SIGTERM)
    signals.restore()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "exits 75" in lines[0]
    assert lines[1].startswith("dataparallel: SIGTERM again") and "within 25 s" in lines[1]
    assert signal.getsignal(signal.SIGTERM) is not signals._handle
    assert not preempting(os.getpid()).exists()  # the mark goes with the handlers


def test_a_worker_keeps_the_first_signal(kept_handlers):
    signals = WorkerSignals().install()
    assert signals.received is None
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received == signal.SIGUSR1


def test_a_workers_sigterm_is_a_preemption_only_once_its_launcher_marked_one(monkeypatch):
    """The agent also stops the survivors of a failure with SIGTERM: without its launcher's
    mark a worker's SIGTERM is not a preemption (the worker ends at once, as before)."""
    monkeypatch.setattr(preemption, "MARK_WAIT_S", 0.05)
    launcher = 2**22 + 12345  # no such launcher: never marked
    preempting(launcher).unlink(missing_ok=True)
    assert WorkerSignals(launcher)._preempting() is False
    preempting(launcher).touch()
    try:
        assert WorkerSignals(launcher)._preempting() is True
    finally:
        preempting(launcher).unlink()
    assert WorkerSignals(None)._preempting() is True  # no launcher of ours: the scheduler's


def test_the_agent_leaves_the_preemption_signals_to_us_and_waits_the_budget():
    argv = torchrun_argv(LaunchConfig(nproc=2, preempt_budget=7.5), ["script.py"], port=1234)
    assert "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT" in argv
    timeout = [a for a in argv if a.startswith("--shutdown-timeout")]
    default = torchrun_argv(LaunchConfig(), ["script.py"], port=1234)
    if "--shutdown-timeout" in agent_flags():  # torch 2.13's torchrun (2.11's has none)
        assert timeout == ["--shutdown-timeout=8"]  # whole seconds, rounded up
        assert "--shutdown-timeout=25" in default
    else:
        assert timeout == []


def test_a_torchrun_without_shutdown_timeout_is_not_given_one():
    # torch 2.11's torchrun (the GPU machine's) refused the option: "unrecognized arguments"
    assert shutdown_timeout(7.5, frozenset({"--nnodes", "--shutdown-timeout"})) == [
        "--shutdown-timeout=8"
    ]
    assert shutdown_timeout(7.5, frozenset({"--nnodes"})) == []
    assert AGENT_FIXED_SHUTDOWN_S > LaunchConfig().preempt_budget


def test_a_budget_under_a_second_is_refused():
    with pytest.raises(ConfigError, match=r"--preempt-budget \(launch.preempt_budget\): 0.5"):
        check_launch(LaunchConfig(preempt_budget=0.5))


def on_a_thread(function):
    """What `function()` returns (or raises) when called on a thread of its own (Ray Train's
    way)."""
    outcome = {}

    def call():
        try:
            outcome["returned"] = function()
        except Exception as error:  # noqa: BLE001 - raised again on the caller's thread
            outcome["raised"] = error

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    if "raised" in outcome:
        raise outcome["raised"]
    return outcome["returned"]


def test_signal_handlers_only_on_the_main_thread(kept_handlers):
    assert signals_allowed() is True
    assert on_a_thread(signals_allowed) is False
    before = {s: signal.getsignal(s) for s in preemption.PREEMPT_SIGNALS}
    launcher = on_a_thread(lambda: LauncherSignals(budget_s=25).install())
    assert {s: signal.getsignal(s) for s in preemption.PREEMPT_SIGNALS} == before
    on_a_thread(launcher.restore)  # nothing to restore: no error, nothing changed
    assert {s: signal.getsignal(s) for s in preemption.PREEMPT_SIGNALS} == before
    with pytest.raises(ValueError, match="main thread of the main interpreter"):
        on_a_thread(lambda: signal.signal(signal.SIGUSR1, signal.SIG_DFL))  # Python's rule

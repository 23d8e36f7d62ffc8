"""[Note: stopped workers]: a stopped child told to end is continued, and ends; a child merely
stopped is left alone."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dataparallel.launch.stopped_workers import StoppedWorkers, stopped_with_ending_signal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, states: str) -> None:
    deadline = time.monotonic() + 5
    while _state(pid) not in states:
        assert time.monotonic() < deadline, _state(pid)
        time.sleep(0.01)


def test_a_stopped_child_with_sigterm_pending_is_continued_and_ends():
    ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for child in (ending, idle):
            os.kill(child.pid, signal.SIGSTOP)
            _wait_state(child.pid, "T")
        os.kill(ending.pid, signal.SIGTERM)  # pending: a stopped process cannot take it
        time.sleep(0.1)
        assert stopped_with_ending_signal(ending.pid)
        assert not stopped_with_ending_signal(idle.pid)
        watcher = StoppedWorkers()
        watcher.check()
        assert watcher.continued == [ending.pid]
        assert ending.wait(timeout=5) == -signal.SIGTERM
        assert _state(idle.pid) == "T"  # an operator's stop, nothing pending: left alone
    finally:
        for child in (ending, idle):
            child.kill()
            child.wait()

"""A joined worker without processes: the run file that points at the launcher's store, the
joiner's heartbeat and the launcher's handle on it (train/live/store.py, remote.py),
on an in-memory store."""

from __future__ import annotations

import signal
import time

import pytest
import torch.distributed as dist

from dataparallel.train.config import ConfigError
from dataparallel.train.live.remote import SILENT, Heartbeat, RemoteProcess
from dataparallel.train.live.store import RUN_FILE, read_run_file, write_run_file


def test_the_run_file_names_the_store_and_its_absence_is_one_line(tmp_path):
    run = tmp_path / "run"
    assert write_run_file(run, "10.0.0.7:41234") == run / RUN_FILE
    assert read_run_file(run) == "10.0.0.7:41234"
    assert [p.name for p in run.iterdir()] == [RUN_FILE]  # the partial file was renamed
    with pytest.raises(ConfigError, match=r"^RUN_DIR: .* has no live run \(no live.json"):
        read_run_file(tmp_path / "elsewhere")


def test_a_beating_joiner_lives_until_it_says_bye():
    store = dist.HashStore()
    heartbeat = Heartbeat(store, slot=3).start()
    process = RemoteProcess(store, slot=3, pid=4242, timeout_s=5.0)
    time.sleep(0.1)
    assert process.poll() is None and store.add("beat/3", 0) >= 1
    heartbeat.stop(0)
    assert process.wait(timeout=1.0) == 0 and process.returncode == 0


def test_a_joiner_whose_heartbeat_stops_has_ended_silently():
    process = RemoteProcess(dist.HashStore(), slot=4, pid=1, timeout_s=0.2)
    assert process.poll() is None
    assert process.wait(timeout=2.0) == SILENT


def test_the_launchers_signals_are_raised_in_the_joiner_each_once():
    """Each new signal the launcher sends is raised (SIGTERM, then SIGKILL after its grace);
    one with a handler does not end the process, so the joiner's own exit says its status."""
    store, received = dist.HashStore(), []
    handler = lambda number, frame: received.append(number)  # noqa: E731
    previous = {n: signal.signal(n, handler) for n in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        heartbeat = Heartbeat(store, slot=5).start()
        process = RemoteProcess(store, slot=5, pid=1)
        for number, count in ((signal.SIGUSR1, 1), (signal.SIGUSR2, 2)):
            process.send_signal(number)
            deadline = time.monotonic() + 5.0
            while len(received) < count and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(1.2)  # two more beats: nothing is raised twice
        assert received == [signal.SIGUSR1, signal.SIGUSR2]
        assert process.poll() is None  # handled: the process goes on
        heartbeat.stop(0)
        assert process.poll() == 0  # what it said as it ended
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)

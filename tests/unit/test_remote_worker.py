"""A joined worker without processes: the run file that points at the launcher's store, the
joiner's heartbeat and the launcher's handle on it (train/remote.py), on an in-memory store."""

from __future__ import annotations

import signal
import time

import pytest
import torch.distributed as dist

from dataparallel.train.config import ConfigError
from dataparallel.train.remote import (
    RUN_FILE,
    SILENT,
    Heartbeat,
    RemoteProcess,
    read_run_file,
    write_run_file,
)


def test_the_run_file_names_the_store_and_its_absence_is_one_line(tmp_path):
    run = tmp_path / "run"
    assert write_run_file(run, "10.0.0.7:41234") == run / RUN_FILE
    assert read_run_file(run) == "10.0.0.7:41234"
    assert [p.name for p in run.iterdir()] == [RUN_FILE]  # the partial file was renamed
    with pytest.raises(ConfigError, match=r"^RUN_DIR: .* has no live run \(no live.json"):
        read_run_file(tmp_path / "elsewhere")


def test_a_beating_joiner_lives_until_it_says_bye():
    store = dist.HashStore()
    heartbeat = Heartbeat(store, replica=3).start()
    process = RemoteProcess(store, replica=3, pid=4242, timeout_s=5.0)
    time.sleep(0.1)
    assert process.poll() is None and store.add("beat/3", 0) >= 1
    heartbeat.stop(0)
    assert process.wait(timeout=1.0) == 0 and process.returncode == 0


def test_a_joiner_whose_heartbeat_stops_has_ended_silently():
    process = RemoteProcess(dist.HashStore(), replica=4, pid=1, timeout_s=0.2)
    assert process.poll() is None
    assert process.wait(timeout=2.0) == SILENT


def test_the_launchers_signal_is_raised_in_the_joiner():
    store, received = dist.HashStore(), []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))
    try:
        heartbeat = Heartbeat(store, replica=5).start()
        process = RemoteProcess(store, replica=5, pid=1)
        process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5.0
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [signal.SIGUSR1]
        assert process.poll() == -signal.SIGUSR1  # what the joiner said before raising it
        heartbeat.stop(0)
    finally:
        signal.signal(signal.SIGUSR1, previous)

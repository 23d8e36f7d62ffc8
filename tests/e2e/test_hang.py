"""A stalled worker is named and ends the run: `dataparallel train --collective-timeout 5` with 2
workers, one of them stopped (SIGSTOP) once training has started ([Note: watchdog] in
comm/watchdog.py).

The other worker's watchdog must print one line naming the stopped rank and the collective it
never arrived at, within the timeout plus a few seconds, and the command must exit (status 1)
within the timeout plus 10 s with no worker left, although nothing continues the stopped worker:
the launcher continues it once torchrun's agent has told it to end ([Note: stopped workers] in
launch/stopped_workers.py). Before, the agent waited its 30 s shutdown timeout on it. The
latencies are measured and printed (docs/watchdog.md, docs/faults.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from worker_pids import process_name, workers_by_rank

from .helpers import CORPUS, TINY

TIMEOUT_S = 5
ARGS = [
    *TINY,
    "--steps", "5000",  # never reached: the run is stopped long before
    "--eval-every", "0",
    "--checkpoint-every", "0",
    "--log-every", "1",
    "--collective-timeout", str(TIMEOUT_S),
    "--max-restarts", "0",  # the run ends at the hang (restarts would resume it)
]  # fmt: skip


class _Lines:
    """Lines of a stream with the time.monotonic() each arrived, read on a thread."""

    def __init__(self, stream):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, fragment: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in list(self.lines) if fragment in line), None)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} within {seconds} s")


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_worker_is_named_within_the_timeout(tmp_path: Path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dataparallel.cli", "train", "--data", str(CORPUS)]
    launcher = subprocess.Popen(
        [*command, *ARGS, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = _Lines(launcher.stdout), _Lines(launcher.stderr)
    workers: dict[int, int] = {}
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(
            lambda: metrics.exists() and '"kind": "train"' in metrics.read_text(),
            120,
            "no training step",
        )
        workers = _wait_for(
            lambda: len(found := workers_by_rank(launcher.pid)) == 2 and found, 10, ""
        )
        # forked from the launcher ([Note: forked workers] in launch/forked.py)
        assert {r: process_name(pid) for r, pid in workers.items()} == {
            0: "dp rank 0",
            1: "dp rank 1",
        }
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        found = _wait_for(
            lambda: stderr.first("collective timeout:"), TIMEOUT_S + 20, "no timeout line"
        )
        latency = found[0] - stopped_at
        launcher.wait(timeout=TIMEOUT_S + 60)  # nothing continues the stopped worker here
        ended = time.monotonic() - stopped_at
        print(
            f"\ndetection latency: {latency:.2f} s, exit after {ended:.2f} s "
            f"(timeout {TIMEOUT_S} s)\n{found[1]}"
        )
    finally:
        # The stopped worker, continued here only to be killed, may print its own timeout in
        # between: the lines that count are those from before this clean-up.
        cleanup_at = time.monotonic()
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    stdout.thread.join(5)
    stderr.thread.join(5)
    line = found[1]
    context = f"stdout:\n{stdout.text()}\nstderr:\n{stderr.text()}"
    # Not before the timeout; within it plus one 0.5 s tick, and room for a loaded machine.
    assert TIMEOUT_S <= latency < TIMEOUT_S + 10, context
    # Stopped between collectives, rank 1 "never arrived"; stopped inside one (its part not
    # sent yet), it "stopped responding inside" it. Either way it is named, with the collective.
    named = re.match(
        r"collective timeout: rank 1 (never arrived at|stopped responding inside) "
        r"(all_reduce|broadcast|reduce_scatter|all_gather) #\d+ (\([^)]*\) )?on ranks 0-1: "
        r"rank 0 waited (\d+\.\d) s \(rank 1 is not responding, last reported at #\d+\); ",
        line,
    )
    assert named, context
    assert TIMEOUT_S <= float(named.group(4)) < TIMEOUT_S + 2, line
    timeouts = [x for x in stderr.lines if "collective timeout:" in x[1] and x[0] < cleanup_at]
    assert len(timeouts) == 1, context
    assert launcher.returncode == 1
    assert ended < TIMEOUT_S + 10, f"the command exited {ended:.1f} s after the stop"
    for pid in workers.values():  # nothing left behind
        assert not _alive(pid)


pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")

"""How long a stalled worker keeps `dataparallel train` alive: stop one worker with SIGSTOP and
time the watchdog's line and the command's exit, with nothing continuing the stopped worker.

    python benchmarks/stall_to_exit.py --collective-timeout 20

gpt-tiny on 2 workers, `--max-restarts 0`; rank 1 is stopped after the first logged step.
The figures are in docs/faults.md ("Faster verdicts"). tests/e2e/test_hang.py checks the same
with a 5 s timeout.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return direct + [g for c in direct for g in _children(c)]


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)


def trial(timeout_s: int) -> tuple[float, float, int]:
    """(seconds from the stop to the line, seconds from the stop to the exit, exit status)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = [
            sys.executable, "-m", "dataparallel.cli", "train", "--nproc", "2", "--threads", "1",
            "--model", "gpt-tiny", "--block-size", "32", "--batch", "4", "--steps", "5000",
            "--eval-every", "0", "--checkpoint-every", "0", "--log-every", "1",
            "--collective-timeout", str(timeout_s), "--max-restarts", "0", "--out", str(out),
        ]  # fmt: skip
        launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        lines: list[tuple[float, bytes]] = []
        reader = threading.Thread(
            target=lambda: [lines.append((time.monotonic(), x)) for x in launcher.stderr],
            daemon=True,
        )
        reader.start()
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and b'"kind": "train"' in metrics.read_bytes()):
            time.sleep(0.05)
        workers = {_rank_of(p): p for p in _children(launcher.pid)}
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        status = launcher.wait(timeout=300)
        ended = time.monotonic() - stopped
        reader.join(5)
        line = next((t for t, x in lines if b"collective timeout:" in x), float("nan"))
        for pid in workers.values():  # in case the launcher left one behind
            try:
                os.kill(pid, signal.SIGKILL)
                print(f"worker {pid} was left behind")
            except ProcessLookupError:
                pass
        return line - stopped, ended, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collective-timeout", type=int, default=20)
    parser.add_argument("--trials", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.trials):
        line, ended, status = trial(args.collective_timeout)
        print(
            f"timeout {args.collective_timeout} s: line after {line:.1f} s, "
            f"exit after {ended:.1f} s, status {status}"
        )


if __name__ == "__main__":
    main()

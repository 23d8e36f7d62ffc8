"""How long a stalled worker keeps `dataparallel train` alive: stop one worker with SIGSTOP and
time the watchdog's line and the command's exit, with nothing continuing the stopped worker.

    python benchmarks/stall_to_exit.py --collective-timeout 20
    python benchmarks/stall_to_exit.py --collective-timeout 20 --restart   # time to new workers

gpt-tiny on 2 workers, `--max-restarts 0`; rank 1 is stopped after the first logged step.
With --restart, `--max-restarts 1`: the time until a new rank 1 runs (then the run is killed).
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

# The helpers this script shares with the tests (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from worker_pids import workers_by_rank  # noqa: E402


def trial(timeout_s: int, restart: bool = False) -> tuple[float, float, int]:
    """(seconds from the stop to the line, seconds from the stop to the exit, exit status);
    with `restart`, the second figure is the time until a new rank 1 runs."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = [
            sys.executable, "-m", "dataparallel.cli", "train", "--nproc", "2", "--threads", "1",
            "--model", "gpt-tiny", "--block-size", "32", "--batch", "4", "--steps", "5000",
            "--eval-every", "0", "--checkpoint-every", "0", "--log-every", "1",
            "--collective-timeout", str(timeout_s), "--max-restarts", str(int(restart)),
            "--out", str(out),
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
        workers = workers_by_rank(launcher.pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        if restart:
            while workers_by_rank(launcher.pid).get(1) in (None, workers[1]):
                time.sleep(0.05)
            ended = time.monotonic() - stopped
            launcher.kill()  # the workers die with it (train/worker.py)
            status = launcher.wait()
        else:
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
        time.sleep(1)  # the restarted workers, if any, see their launcher gone
        return line - stopped, ended, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collective-timeout", type=int, default=20)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--restart", action="store_true", help="--max-restarts 1")
    args = parser.parse_args()
    for _ in range(args.trials):
        line, ended, status = trial(args.collective_timeout, args.restart)
        what = "new workers" if args.restart else f"exit (status {status})"
        print(
            f"timeout {args.collective_timeout} s: line after {line:.1f} s, {what} after {ended:.1f} s"
        )


if __name__ == "__main__":
    main()

"""The CUDA peak of a process that cannot be asked (gpu_throughput.py's job contender, a
worker started by torchrun): with DP_BENCH_PEAK_FILE set, this directory on PYTHONPATH makes
every Python process write `torch.cuda.max_memory_allocated()` to `$DP_BENCH_PEAK_FILE.<pid>`
every second once CUDA is initialised, and at exit; a process killed in between leaves its
last figure. Nothing happens without the variable, or in a process that never used CUDA."""

import atexit
import os
import sys
import threading

_PATH = os.environ.get("DP_BENCH_PEAK_FILE")


def _write() -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    with open(f"{_PATH}.{os.getpid()}", "w") as f:
        f.write(str(torch.cuda.max_memory_allocated()))


def _poll() -> None:
    while True:
        threading.Event().wait(1.0)
        try:
            _write()
        except Exception:  # the interpreter shutting down under the thread
            return


if _PATH:
    atexit.register(_write)
    threading.Thread(target=_poll, daemon=True, name="peak-probe").start()

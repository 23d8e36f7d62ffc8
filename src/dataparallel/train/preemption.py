"""A worker's side of preemption: the ranks agree at a step boundary, save that step, and stop
([Note: preemption] in launch/preemption.py).

[Note: the preemption flag] A signal reaches the ranks at different moments (or only some of
them: another machine's launcher was not signalled), so each rank's flag is only its own view.
After every step the ranks all-reduce it (MAX of one int over the world group, on the device):
every rank sees the same answer after the same step, and all of them save that step together.
Its cost is one tiny collective per step (BENCHMARKS.md, "Preemption": measured against the
step it follows). The `.item()` is no extra host sync: the step's record already read its loss.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import latest_checkpoint, step_name
from ..comm.progress import watched
from ..launch.preemption import PREEMPTED, WorkerSignals
from ..launch.workers import ENV_LAUNCHER
from . import checkpointing
from .callbacks import Callback
from .checkpointing import CheckpointSaver
from .ledger import StepRecord
from .run_dir import CHECKPOINTS
from .state import TrainState

# Tests only: seconds every rank sleeps inside the preemption save, after its files are written
# and before rank 0 commits them, so that a test can kill a save half done.
ENV_SLOW_SAVE = "DATAPARALLEL_TEST_SLOW_SAVE_S"


class Preempted(Exception):
    """Every rank stopped after `step` on a preemption signal and saved it (exit PREEMPTED)."""

    def __init__(self, step: int, signal_name: str, save_s: float):
        super().__init__(f"preempted ({signal_name}) after step {step}")
        self.step, self.signal_name, self.save_s = step, signal_name, save_s


class Preemption(Callback):
    """After each step, agree on the ranks' preemption flags ([Note: the preemption flag]); when
    one is up, save this step synchronously (keeping a checkpoint of this step already written)
    and raise Preempted.

    signals: this process's flag (installed handlers).
    saver: the run's CheckpointSaver, whose checkpointer writes the checkpoint.
    """

    def __init__(self, signals: WorkerSignals, saver: CheckpointSaver):
        self.signals = signals
        self.saver = saver
        self.flag: torch.Tensor | None = None
        self.agree_s = 0.0  # time spent agreeing, for the benchmark

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        started = time.perf_counter()
        mine = self.signals.received
        agreed = self._agree(state, int(mine or 0))
        self.agree_s += time.perf_counter() - started
        if not agreed:
            return
        name = signal.Signals(agreed).name
        tell_launcher(signal.Signals(agreed))
        started = time.perf_counter()
        checkpointer = self.saver.checkpointer
        checkpointer.wait()  # a periodic save of this step (or an earlier one) in flight
        latest = latest_checkpoint(self.saver.run_dir / CHECKPOINTS)
        if latest is None or latest.name != step_name(state.step):
            with _slowed(float(os.environ.get(ENV_SLOW_SAVE, "0"))):
                checkpointer.save(state)
                checkpointer.wait()
        raise Preempted(state.step, name, time.perf_counter() - started)

    def _agree(self, state: TrainState, mine: int) -> int:
        """The highest signal number any rank received (0: none), the same on every rank."""
        if state.world.world_size == 1:
            return mine
        if self.flag is None:
            self.flag = torch.zeros(1, dtype=torch.int32, device=state.world.device)
        self.flag.fill_(mine)
        # Watched like every collective of the step: a rank that stalls before it is named.
        with watched(state.world.group, "all_reduce", self.flag, what="preemption flag"):
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=state.world.group)
        return int(self.flag.item())


def tell_launcher(sig: signal.Signals) -> None:
    """Pass a preemption on to our launcher (the parent that started this worker), so that it
    stops the agent for good instead of restarting the workers; it ignores repeats."""
    launcher = os.environ.get(ENV_LAUNCHER)
    first_here = os.environ.get("LOCAL_RANK", "0") == "0"  # one per machine is enough
    if launcher and first_here and int(launcher) == os.getppid():
        try:
            os.kill(int(launcher), sig)
        except ProcessLookupError:
            pass


class _slowed:
    """Tests only ([ENV_SLOW_SAVE]): sleep `seconds` after each rank's files are written."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.original = checkpointing.save_chunks

    def __enter__(self):
        if self.seconds > 0:
            original, seconds = self.original, self.seconds

            def slow(*args, **kwargs):
                original(*args, **kwargs)
                time.sleep(seconds)

            checkpointing.save_chunks = slow

    def __exit__(self, *exc):
        checkpointing.save_chunks = self.original


def preempted_message(error: Preempted, out: str) -> str:
    """Rank 0's lines when the run stops on a preemption."""
    return (
        f"\n{error}; checkpoint {step_name(error.step)} written in {error.save_s:.1f} s; "
        f"exit status {PREEMPTED}\ncontinue with the same command and --resume auto "
        f"(or: dataparallel train --resume {Path(out)})"
    )

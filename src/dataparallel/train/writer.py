"""The one process that writes the run's records: rank 0 of the current world.

    writer = RecordsWriter(run_dir, info, log_every=25, threads=1)   # built on every process
    fit(state, [writer, saver], steps)       # it writes only while its process is rank 0

[Note: the writer role] One process writes the run's records: run.json, metrics.jsonl, the
trackers' (TensorBoard's events, W&B, MLflow: [Note: trackers] in trackers.py), the progress
lines and blame's warnings; the checkpoints' plain state, the final weights and the report
(its plots sent to the trackers) are written where `state.world.is_main` holds, which is the
same process. The *writer* is rank 0 of the current world. In a plain run that never changes.
In a live run (train/live/recovery.py) the world is the current generation and its rank 0 the
lowest live slot, so the role follows the membership:
- slot 0 lost: the survivors regroup as for any slot, and the new rank 0 takes the role over
  at its next record (`take_over`): it cuts metrics.jsonl to the complete records before
  that record's position (a line the lost writer was killed while writing goes, and so do
  records it wrote of a step the survivors redo), then writes, from memory, the records
  before that position that the file lacks (every member keeps the session's step and
  evaluation records: `state.ledger.history`, `.evals`); so every step is in the file once.
- slot 0's replacement let in: it is rank 0 again and takes the role at its first record;
  the member that held it hands it over (closes its files) at its next.
- the writer let leave (`dataparallel leave`): it leaves at a step boundary, after its records
  of that step, and closes its files (`on_leave`); the next lowest member takes the role at
  its next record, which follows in the file.
Every process is built with the same callbacks, and each asks at every record whether it is
rank 0 of its current world; every member learns a generation before it records anything in
it, so two processes never write at once, and none writes a record twice.
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path

from .blame import Blame
from .callbacks import Callback
from .console import ProgressBar
from .ledger import EvalRecord, StepRecord
from .metrics import MetricsLogger, after_step, position, start_position
from .report import make_report
from .run_dir import RUN_INFO
from .state import TrainState
from .trackers import report_images, tracker_names


class Role(enum.Enum):
    """Whether this process writes the run's records."""

    WAITING = "waiting"  # not rank 0 of its world: another process writes
    WRITING = "writing"  # rank 0 of its world
    ENDED = "ended"  # the loop ended


def write_info(run_dir: Path, info: dict) -> None:
    """run.json, replaced at once (written aside, then renamed): a writer killed while writing
    it leaves the previous one whole."""
    path = Path(run_dir) / RUN_INFO
    aside = path.with_name(RUN_INFO + ".tmp")
    aside.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(aside, path)


class RecordsWriter(Callback):
    """The run's records, written by rank 0 of the current world ([Note: the writer role]).

    run_dir: the run directory.
    info: run.json as this process made it at its start: written when the session starts, and
        by a writer taking over if the file is missing; None (a live run's replacement, which
        starts after the run): this process never writes it.
    log_every: steps between progress lines (ProgressBar) and between the train scalars the
        trackers get ([Note: the trackers' cadence] in trackers.py).
    threads: this process's threads, for the progress header.
    report_to: the trackers that also get the metrics, the config and the report's plots
        (trackers.py; checked before the run: `check_trackers`).
    """

    def __init__(
        self,
        run_dir: Path,
        info: dict | None,
        *,
        log_every: int,
        threads: int,
        report_to: tuple[str, ...] = ("tensorboard",),
    ):
        self.run_dir, self.info = Path(run_dir), info
        self.progress = ProgressBar(log_every=log_every, threads=threads)
        trackers = tracker_names(report_to)
        self.metrics = MetricsLogger(self.run_dir, trackers=trackers, every=log_every)
        self.blame = Blame()  # stragglers and non-finite gradients, by rank ([Note: blame])
        self.role = Role.WAITING

    # -- the loop's calls -------------------------------------------------------------------------
    def on_start(self, state: TrainState) -> None:
        if not state.world.is_main:
            return
        if self.info is None:  # a replacement let in as rank 0: the run is under way
            self.take_over(state, start_position(state))
            return
        write_info(self.run_dir, self.info)
        self.progress.on_start(state)
        self.metrics.open(state, start_position(state))
        self.role = Role.WRITING

    def on_eval(self, state: TrainState, record: EvalRecord) -> None:
        if self._follow(state, position("val", record.step)):
            self.progress.on_eval(state, record)
            self.metrics.on_eval(state, record)

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        if self._follow(state, position("train", record.step)):
            self.progress.on_step(state, record)
            self.metrics.on_step(state, record)
            self.blame.on_step(state, record)

    def on_skip(self, state: TrainState, record: StepRecord) -> None:
        if self._follow(state, after_step(state.step)):
            self.blame.on_skip(state, record)

    def on_rewind(self, state: TrainState) -> None:
        """The run went back to `state.step` ([Note: live averaging] in live/rewind.py): the records
        after it are cut (TensorBoard's purged) and written again as the steps are redone."""
        if self.role is Role.WRITING:
            self.metrics.close()
            self.role = Role.WAITING
        if state.world.is_main:
            self.take_over(state, after_step(state.step))

    def on_leave(self, state: TrainState) -> None:
        """Left the run (`dataparallel leave`): a writer closes its files (TensorBoard's events
        flushed); the next lowest member takes the role at its next record."""
        if self.role is Role.WRITING:
            self.hand_over(state)
        self.role = Role.ENDED

    def on_end(self, state: TrainState) -> None:
        if self._follow(state, after_step(state.step)):
            self.progress.on_end(state)
            self.metrics.close(keep_trackers=True)  # they get the report's plots (`report`)
        self.role = Role.ENDED

    def report(self, state: TrainState) -> str:
        """The writer's last act, after the loop: the run's report (make_report), its plots sent
        to the trackers, which then finish; the summary's text."""
        text = make_report(self.run_dir)
        self.metrics.trackers.log_images(report_images(self.run_dir), state.step)
        self.metrics.trackers.finish(ok=True)
        return text

    def close_trackers(self, *, ok: bool) -> None:
        """Finish the trackers still open (a run that failed: `ok` False); nothing after
        `report`."""
        self.metrics.trackers.finish(ok=ok)

    # -- the role -------------------------------------------------------------------------------
    def _follow(self, state: TrainState, upto: int) -> bool:
        """Take the role or hand it over as the current world says, before the record at
        position `upto`; whether this process writes it."""
        if self.role is Role.ENDED:
            raise RuntimeError("RecordsWriter: a record after the loop ended")
        main = state.world.is_main
        if main and self.role is Role.WAITING:
            self.take_over(state, upto)
        elif not main and self.role is Role.WRITING:
            self.hand_over(state)
        return self.role is Role.WRITING

    def take_over(self, state: TrainState, upto: int) -> None:
        """Begin writing at position `upto` in a run under way: the records before it that the
        file lacks are written from memory (MetricsLogger.open)."""
        if self.info is not None and not (self.run_dir / RUN_INFO).exists():
            write_info(self.run_dir, self.info)  # the writer was lost before it wrote it
        self.metrics.open(state, upto)
        self.role = Role.WRITING

    def hand_over(self, state: TrainState) -> None:
        """Stop writing: another process is rank 0 now (it opens the files again)."""
        self.progress.on_end(state)
        self.metrics.close()
        self.role = Role.WAITING

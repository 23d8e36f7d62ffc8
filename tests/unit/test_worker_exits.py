"""`run_worker`'s exits as one table (train/worker.py `EXITS`): each error the run ends on, its
exit code, who says what and where, and what is closed first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dataparallel.checkpoint import CheckpointError
from dataparallel.comm.progress import CollectiveMismatch
from dataparallel.data.formats import DataError
from dataparallel.launch.preemption import PREEMPTED
from dataparallel.train import worker
from dataparallel.train.live.recovery import Dropped, Released
from dataparallel.train.live.replica import ReplicaLost
from dataparallel.train.preemption import Preempted


class Recorder:
    def __init__(self):
        self.calls = []

    def on_leave(self, state):
        self.calls.append("leave")


CASES = [
    # error, code, stream, spoken by a rank that is not the run's rank 0, leaves, line's start
    (KeyboardInterrupt(), 130, "out", False, False, "\ninterrupted at step 7; no checkpoint yet"),
    (Preempted(7, "SIGTERM", 1.5), PREEMPTED, "out", False, True, "\n"),
    (Dropped("late"), 1, "err", True, False, "dataparallel train: live: late"),
    (ReplicaLost("gone"), 1, "err", True, False, "dataparallel train: live: gone"),
    (Released("asked"), 0, "err", True, True, "dataparallel train: live: asked"),
    (FloatingPointError("nan"), 1, "err", False, False, "dataparallel train: error: nan"),
    (CollectiveMismatch("x"), 1, "err", False, False, "dataparallel train: error: x"),
    (CheckpointError("bad"), 2, "err", False, False, "dataparallel train: error: bad"),
    (DataError("empty", "give more"), 2, "err", False, False, "dataparallel train: error: "),
]


@pytest.mark.parametrize("error,code,stream,everyone,leaves,line", CASES)
@pytest.mark.parametrize("main", [True, False])
def test_each_error_ends_the_worker_as_the_table_says(
    error, code, stream, everyone, leaves, line, main, tmp_path, capsys
):
    state = SimpleNamespace(step=7, world=SimpleNamespace(is_main=main))
    callback = Recorder()
    assert worker._exit(error, state, None, [callback], str(tmp_path)) == code
    assert callback.calls == (["leave"] if leaves else [])
    out, err = capsys.readouterr()
    said, silent = (out, err) if stream == "out" else (err, out)
    assert silent == ""
    if main or everyone:
        assert said.startswith(line)
    else:
        assert said == ""


def test_the_table_covers_what_run_worker_catches():
    assert len(CASES) == 9
    kinds = {type(error) for error, *_ in CASES}
    assert kinds == set(worker.EXIT_ERRORS)

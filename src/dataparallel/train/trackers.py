"""Where the run's metrics also go (`--report-to`): TensorBoard, Weights & Biases, MLflow.

    trackers = Trackers(("tensorboard", "wandb"), run_dir)   # the writer's ([Note: trackers])
    trackers.start(config, purge_step=0)      # each backend opened; the config as parameters
    trackers.log_record(line)                 # a metrics.jsonl line: its scalars, at its step
    trackers.log_images(report_images(run_dir), step)   # the report's plots, at the end
    trackers.finish()

[Note: trackers] A tracker is one small class per backend behind `Tracker` (start,
log_scalars, log_params, log_images, finish). Only the run's writer holds them ([Note: the
writer role] in writer.py): it starts them when it begins writing (a run's start, a --resume, a
live run's take-over) and finishes them when it stops (the end, after the report's plots; a
hand-over; a leave). A backend's run id is kept in RUN/trackers.json, so every later writer, in
this process or another, a --resume or a take-over, continues the same W&B and MLflow run
rather than starting a second one. The step of every scalar is the optimizer step, as in
metrics.jsonl. A step written again (a --resume from a checkpoint before the interruption, a
live rewind) cannot be erased from W&B or MLflow: MLflow keeps its first values (steps at or
below the last it holds are not sent again), W&B's server drops steps below its last;
metrics.jsonl and TensorBoard (purged) hold the redone values.

[Note: the trackers' cadence] The backends get a train step's scalars every `--log-every` steps
(the console's cadence: 25 by default, as Lightning's `log_every_n_steps` and the Hugging Face
Trainer's `logging_steps` send theirs), the first step, and the last one written when the
writer stops; every evaluation; metrics.jsonl keeps every step. Sent every step, the three
backends cost the training thread 1.3 ms a step on 2 cores (1.7% of gpt-tiny's 78 ms step:
the records queued, and the sending thread's share of the process, BENCHMARKS.md);
`--log-every 1` sends every step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

from .config import ConfigError, RunConfig, field_label
from .run_dir import REPORT, TENSORBOARD, TRACKER_IDS


class Tracker(Protocol):
    """One backend the writer reports to ([Note: trackers])."""

    def start(self, run_dir: Path, *, purge_step: int) -> None:
        """Open the backend's run (the one in RUN/trackers.json if there is one); purge_step:
        the first step this writer writes (TensorBoard drops its events from there)."""

    def log_scalars(self, values: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, object]) -> None: ...

    def log_images(self, images: dict[str, Path], step: int) -> None: ...

    def finish(self, ok: bool) -> None: ...


class TensorBoardTracker:
    """Events under RUN/tensorboard (torch's SummaryWriter); parameters as one text entry."""

    def start(self, run_dir: Path, *, purge_step: int) -> None:
        # Imported here: TensorBoard's import takes a second, and only the writer needs it.
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=purge_step)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_params(self, params: dict[str, object]) -> None:
        lines = [f"    {key} = {value!r}" for key, value in params.items()]
        self.writer.add_text("config", "\n".join(lines), 0)

    def log_images(self, images: dict[str, Path], step: int) -> None:
        from matplotlib.image import imread

        for key, path in images.items():
            self.writer.add_image(key, imread(path), step, dataformats="HWC")

    def finish(self, ok: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run: named after RUN, its files under RUN/wandb, its id in RUN/trackers.json.
    wandb's own variables apply (WANDB_MODE=offline, WANDB_PROJECT, WANDB_ENTITY...)."""

    def start(self, run_dir: Path, *, purge_step: int) -> None:
        import wandb

        stored = read_ids(run_dir).get("wandb", {})
        run_id = stored.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "dataparallel"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            settings=wandb.Settings(silent=True, console="off"),
        )
        write_id(run_dir, "wandb", {"id": run_id})
        self.wandb = wandb

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def log_params(self, params: dict[str, object]) -> None:
        self.run.config.update(params, allow_val_change=True)  # a --resume may change some

    def log_images(self, images: dict[str, Path], step: int) -> None:
        self.run.log({k: self.wandb.Image(str(p)) for k, p in images.items()}, step=step)

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """An MLflow run in $MLFLOW_TRACKING_URI, else the file store RUN/mlruns; experiment
    $MLFLOW_EXPERIMENT_NAME, else "dataparallel"; its run id in RUN/trackers.json."""

    def start(self, run_dir: Path, *, purge_step: int) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:  # MLflow 3 asks for this opt-in before it opens a file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri or (run_dir / "mlruns").resolve().as_uri())
        stored = read_ids(run_dir).get("mlflow", {})
        if stored.get("run_id") and stored.get("tracking_uri", "") == uri:
            self.run_id = stored["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._create(run_dir)
            write_id(run_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        history = self.client.get_metric_history
        # The last step of each key it holds: those steps are not sent again ([Note: trackers])
        self.last = {k: max((m.step for m in history(self.run_id, k)), default=-1) for k in KEYS}
        self.params = dict(self.client.get_run(self.run_id).data.params)

    def _create(self, run_dir: Path) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dataparallel")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        tags = {"dataparallel.run_dir": str(run_dir.resolve())}
        return self.client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, value, now, step)
            for key, value in values.items()
            if step > self.last.get(key, -1)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
            self.last.update((m.key, step) for m in metrics)

    def log_params(self, params: dict[str, object]) -> None:
        """MLflow refuses to change a parameter: a resumed run's new values (--steps 2000) stay
        in its config.toml; the first session's are the run's parameters."""
        from mlflow.entities import Param

        text = {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in params.items()}
        new = [Param(k, v) for k, v in text.items() if k not in self.params]
        for first in range(0, len(new), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(self.run_id, params=new[first : first + 100])
        self.params.update(text)

    def log_images(self, images: dict[str, Path], step: int) -> None:
        for path in images.values():
            self.client.log_artifact(self.run_id, str(path), "report")

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


BACKENDS: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
# The module each backend imports, and how to get it.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = {
    "tensorboard": "pip install tensorboard",
    "wandb": 'pip install "dataparallel[wandb]"',
    "mlflow": 'pip install "dataparallel[mlflow]"',
}
# What each metrics.jsonl line gives the trackers: {its field: the tracker's key}.
SCALARS = {
    "train": {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s",
    },
    "val": {"val_loss": "val/loss"},
}
KEYS = [key for fields in SCALARS.values() for key in fields.values()]


def tracker_names(report_to: tuple[str, ...]) -> tuple[str, ...]:
    """The backends `--report-to` names, in order, once each: comma-separated or as separate
    words ("tensorboard,wandb" or "tensorboard wandb"); "none" alone for none."""
    names = [n.strip() for item in report_to for n in item.split(",") if n.strip()]
    label, known = field_label("train", "report_to"), ", ".join(BACKENDS)
    if names == ["none"]:
        return ()
    if not names:
        raise ConfigError(label, "no tracker named", f"give some of {known}, or none")
    for name in names:
        if name not in BACKENDS:
            problem = "none goes alone" if name == "none" else f"unknown tracker {name!r}"
            raise ConfigError(label, problem, f"choose from {known} (comma-separated), or none")
    return tuple(dict.fromkeys(names))


def check_trackers(report_to: tuple[str, ...]) -> None:
    """The names are known and each backend's package is installed (looked up, not imported)."""
    for name in tracker_names(report_to):
        package = PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"--report-to {name} (train.report_to)",
                f"the {package} package is not installed",
                INSTALL[name],
            )


def read_ids(run_dir: Path) -> dict:
    """RUN/trackers.json: each backend's run id ({} before any)."""
    path = Path(run_dir) / TRACKER_IDS
    return json.loads(path.read_text()) if path.exists() else {}


def write_id(run_dir: Path, name: str, value: dict) -> None:
    """Keep backend `name`'s run id in RUN/trackers.json (written aside, then renamed)."""
    ids = read_ids(run_dir)
    if ids.get(name) == value:
        return
    path = Path(run_dir) / TRACKER_IDS
    aside = path.with_name(TRACKER_IDS + ".tmp")
    aside.write_text(json.dumps({**ids, name: value}, indent=2) + "\n")
    os.replace(aside, path)


def flat_params(config: RunConfig, run_dir: Path) -> dict[str, object]:
    """The resolved config as "section.field" parameters (lists for tuples), and the run dir."""
    params: dict[str, object] = {"run_dir": str(Path(run_dir).resolve())}
    for section, values in config.to_dict().items():
        for name, value in values.items():
            params[f"{section}.{name}"] = list(value) if isinstance(value, tuple) else value
    return params


def report_images(run_dir: Path) -> dict[str, Path]:
    """The report's plots (report.py), as {"report/loss": path, ...}."""
    folder = Path(run_dir) / REPORT
    return {f"report/{path.stem}": path for path in sorted(folder.glob("*.png"))}


class Trackers:
    """The backends `--report-to` names, as one: what the writer calls ([Note: trackers]).

    names: backends from BACKENDS (checked before the run: `check_trackers`).
    run_dir: the run directory.
    every: steps between two steps' train scalars sent (`--log-every`; [Note: the trackers'
        cadence]); 1 for every step.
    """

    def __init__(self, names: tuple[str, ...], run_dir: Path, every: int = 1):
        self.names, self.run_dir = names, Path(run_dir)
        self.every = max(1, every)
        self.held: tuple[dict, int] | None = None  # the last train step not sent yet
        self.open: list[Tracker] = []
        # [Note: trackers off the step] The scalars go through a queue to one thread that calls
        # the backends, so the training thread only enqueues (measured on the step of gpt-tiny
        # on 2 cores: TensorBoard, W&B and MLflow took 0.4, 0.3 and 0.6 ms a record when called
        # in line, about 1.3% of a 100 ms step); the queue is drained before the images and
        # before finishing, and a backend's error is raised then, on the training thread.
        self.queue: queue.Queue | None = None
        self.error: BaseException | None = None

    def start(self, config: RunConfig, *, purge_step: int) -> None:
        """Open every backend, the resolved config as the run's parameters."""
        params = flat_params(config, self.run_dir)
        for name in self.names:
            tracker = BACKENDS[name]()
            tracker.start(self.run_dir, purge_step=purge_step)
            self.open.append(tracker)
            tracker.log_params(params)
        if self.open:
            self.queue = queue.Queue()
            threading.Thread(target=self._send, name="trackers", daemon=True).start()

    def _send(self) -> None:
        """The thread that calls the backends, until it takes None."""
        while (item := self.queue.get()) is not None:
            try:
                if self.error is None:
                    for tracker in self.open:
                        tracker.log_scalars(*item)
            except BaseException as error:  # noqa: BLE001 - raised on the training thread
                self.error = error
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _drain(self) -> None:
        """Wait until the thread sent what was queued; raise a backend's error here."""
        if self.queue is not None:
            self.queue.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"--report-to: a tracker failed: {error!r}") from error

    def log_record(self, record: dict) -> None:
        """A metrics.jsonl line's scalars (SCALARS), at its step: every evaluation; a train
        step at the cadence ([Note: the trackers' cadence])."""
        if not self.open:
            return
        values = {key: record[field] for field, key in SCALARS[record["kind"]].items()}
        step = record["step"]
        if record["kind"] == "train":
            if step % self.every and step != 1:
                self.held = (values, step)
                return
            self.held = None
        self.queue.put((values, step))

    def log_images(self, images: dict[str, Path], step: int) -> None:
        self._drain()
        for tracker in self.open:
            tracker.log_images(images, step)

    def finish(self, ok: bool = True) -> None:
        """Close every backend (nothing when none is open): the run ended, failed, or the
        writer role moved on."""
        if self.queue is not None:
            if self.held is not None:  # the last step written, off the cadence
                self.queue.put(self.held)
                self.held = None
            self.queue.put(None)  # the thread ends after what is queued
            self.queue.join()
            self.queue = None
        failed, self.error = self.error, None
        while self.open:
            self.open.pop(0).finish(ok and failed is None)
        if failed is not None:
            raise RuntimeError(f"--report-to: a tracker failed: {failed!r}") from failed

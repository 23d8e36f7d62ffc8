"""`dataparallel train --report-to`: what each tracker received, read back from its own files.

One run reports to TensorBoard, W&B (offline) and MLflow (its file store under RUN/), stops
after step 4 of 6 and is resumed, at `--log-every 3`; every scalar the trackers hold must equal
metrics.jsonl's at the same step, each step sent once (the first, every third, the last of each
session, every evaluation), in one W&B run and one MLflow run across the two sessions; the
resolved config is the run's parameters and the report's plots are images. A run with
`--report-to none` writes no tracker's files; MLflow keeps the first value of a step sent again.
"""

from __future__ import annotations

import json

import pytest

from dataparallel.train.config import RunConfig
from dataparallel.train.metrics import read_metrics
from dataparallel.train.trackers import KEYS, Trackers, read_ids

from .helpers import TINY, cli, corpus_copy, ok, tracker_env, wandb_sessions

ARGS = [
    *TINY,
    "--steps", "6",
    "--val-fraction", "0.1",
    "--eval-every", "3",
    "--eval-windows", "7",
    "--checkpoint-every", "2",
    "--max-restarts", "0",
    "--log-every", "3",
]  # fmt: skip
# The train steps the trackers get at --log-every 3 ([Note: the trackers' cadence]): the first,
# the third, the last of the first session (4, off the cadence) and the sixth.
SENT = {1, 3, 4, 6}
# metrics.jsonl's field -> the trackers' key, for each kind of record (trackers.SCALARS)
TRAIN = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
}
VAL = {"val_loss": "val/loss"}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The run: 4 steps, then --resume to 6, reporting to all three trackers."""
    folder = tmp_path_factory.mktemp("trackers")
    run, env = folder / "run", tracker_env(folder)
    every = ["--report-to", "tensorboard,wandb,mlflow"]
    data = ["--data", str(corpus_copy(folder))]
    ok(cli(["train", *data, *ARGS, *every, "--stop-after", "4", "--out", str(run)], env=env))
    ok(cli(["train", "--resume", str(run)], env=env))
    return run


def _expected(run) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {tracker key: {step: value}}."""
    expected: dict[str, dict[int, float]] = {}
    for record in read_metrics(run):
        if record["kind"] == "train" and record["step"] not in SENT:
            continue
        for field, key in (TRAIN if record["kind"] == "train" else VAL).items():
            expected.setdefault(key, {})[record["step"]] = record[field]
    return expected


def test_mlflow_holds_each_step_sent_once_the_config_and_the_plots(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to read one
    ids = json.loads((tracked / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=(tracked / "mlruns").resolve().as_uri())
    run_id = ids["mlflow"]["run_id"]
    (only,) = client.search_runs([client.get_experiment_by_name("dataparallel").experiment_id])
    assert only.info.run_id == run_id and only.info.run_name == "run"  # one run, both sessions
    assert only.info.status == "FINISHED"
    expected = _expected(tracked)
    assert sorted(expected["train/loss"]) == sorted(SENT)  # 4 of metrics.jsonl's 6 steps
    assert sorted(expected["val/loss"]) == [0, 3, 6]
    for key, values in expected.items():  # 5 keys
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == sorted(values), key  # each step once, in order
        assert {m.step: m.value for m in history} == values, key  # exactly metrics.jsonl's
    params = only.data.params
    assert (params["train.steps"], params["model.name"], params["launch.nproc"]) == (
        "6",
        "gpt-tiny",
        "2",
    )
    assert params["train.report_to"] == '["tensorboard,wandb,mlflow"]'
    assert params["run_dir"] == str(tracked.resolve())
    artifacts = sorted(a.path for a in client.list_artifacts(run_id, "report"))
    assert artifacts == ["report/loss.png", "report/throughput.png"]
    for path in artifacts:
        stored = tracked / "mlruns" / only.info.experiment_id / run_id / "artifacts" / path
        assert stored.read_bytes() == (tracked / path).read_bytes()  # the final report's


def test_wandb_continues_one_run_with_the_steps_sent_and_the_plots(tracked):
    ids = json.loads((tracked / "trackers.json").read_text())
    first, second = wandb_sessions(tracked)  # the start and the resume
    assert first["id"] == second["id"] == ids["wandb"]["id"]
    assert first["name"] == second["name"] == "run"
    logged: dict[str, dict[int, float]] = {}
    steps = []
    for session in (first, second):
        for row in session["history"]:
            steps.append(row["_step"])
            for key, value in row.items():
                if not key.startswith(("_", "report/")):
                    assert row["_step"] not in logged.setdefault(key, {}), (key, row["_step"])
                    logged[key][row["_step"]] = value
    # the second session continues after the first; 0: step 0's evaluation
    assert steps == [0, *sorted(SENT)]
    assert logged == _expected(tracked)  # every key, every step sent, exactly (JSON floats)
    config = second["config"]
    assert (config["train.steps"], config["model.name"], config["train.batch"]) == (
        6,
        "gpt-tiny",
        4,
    )
    assert config["train.report_to"] == ["tensorboard,wandb,mlflow"]
    final = second["history"][-1]
    assert final["_step"] == 6
    for name in ("loss", "throughput"):
        image = final[f"report/{name}"]
        assert image["_type"] == "image-file" and image["format"] == "png"
        media = second["folder"] / "files" / image["path"]
        assert media.read_bytes() == (tracked / "report" / f"{name}.png").read_bytes()


def test_tensorboard_holds_the_same_scalars_and_the_plots(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    expected = _expected(tracked)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for key, values in expected.items():
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got == pytest.approx(values, rel=1e-6), key  # TensorBoard stores fp32
    images = {tag: [e.step for e in events.Images(tag)] for tag in events.Tags()["images"]}
    assert images == {"report/loss": [4, 6], "report/throughput": [4, 6]}  # each session's


def test_report_to_none_writes_no_tracker_files(tmp_path):
    run = tmp_path / "run"
    short = [*ARGS, "--nproc", "1", "--steps", "2", "--eval-every", "0", "--checkpoint-every", "0"]
    result = cli(
        ["train", "--data", str(corpus_copy(tmp_path)), *short, "--report-to", "none"]
        + ["--out", str(run)],
        env=tracker_env(tmp_path),
    )
    ok(result)
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2]
    assert (run / "report" / "loss.png").exists()
    for name in ("tensorboard", "wandb", "mlruns", "trackers.json"):
        assert not (run / name).exists(), name
    assert "tensorboard --logdir" not in result.stdout


def test_an_unknown_tracker_is_one_line_naming_the_field_and_the_names(tmp_path):
    result = cli(["train", "--report-to", "tensorboard,wandbb", "--out", str(tmp_path / "r")])
    assert result.returncode == 2
    assert result.stderr == (
        "dataparallel train: error: --report-to (train.report_to): unknown tracker 'wandbb'; "
        "choose from tensorboard, wandb, mlflow (comma-separated), or none\n"
    )
    assert not (tmp_path / "r").exists()


def test_mlflow_keeps_one_run_and_the_first_value_of_a_step_sent_again(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader's own opt-in

    def session(steps: range, loss: float, config: RunConfig) -> None:
        run = Trackers(("mlflow",), tmp_path)
        run.start(config, purge_step=steps.start)
        for step in steps:
            record = {"kind": "train", "step": step, "loss": loss + step, "lr": 0.1}
            run.log_record({**record, "grad_norm": 1.0, "tokens_per_s": 10.0})
        run.log_record({"kind": "val", "step": steps.stop - 1, "val_loss": loss})
        run.finish()

    session(range(1, 6), 10.0, RunConfig())  # interrupted after step 5, checkpoint at 3
    session(range(4, 9), 20.0, RunConfig().replace(train={"steps": 8}))  # resumed at 3
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = read_ids(tmp_path)["mlflow"]["run_id"]
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    assert history == [(s, 10.0 + s) for s in range(1, 6)] + [(s, 20.0 + s) for s in (6, 7, 8)]
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [5, 8]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "500"  # MLflow refuses to change a parameter
    assert len(KEYS) == 5

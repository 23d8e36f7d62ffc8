"""The trackers' pure logic (train/trackers.py): the names --report-to takes, the line for a
package that is not installed, the config as parameters (MLflow's rule for a step written
again is in tests/e2e/test_trackers.py: MLflow starts processes)."""

from __future__ import annotations

import importlib.util

import pytest

from dataparallel.cli import main
from dataparallel.train.config import ConfigError, RunConfig
from dataparallel.train.trackers import (
    check_trackers,
    flat_params,
    tracker_names,
)

NAMES = [
    (("tensorboard",), ("tensorboard",)),
    (("tensorboard,wandb,mlflow",), ("tensorboard", "wandb", "mlflow")),
    (("wandb", "mlflow"), ("wandb", "mlflow")),  # separate words (nargs)
    ((" mlflow , tensorboard ",), ("mlflow", "tensorboard")),
    (("wandb,wandb",), ("wandb",)),
    (("none",), ()),
]
BAD = [
    (("tensorbord",), "unknown tracker 'tensorbord'"),
    (("none,wandb",), "none goes alone"),
    ((",",), "no tracker named"),
    ((), "no tracker named"),
]


def test_names_parse_in_order_once_each():
    for given, names in NAMES:
        assert tracker_names(given) == names, given
    assert len(NAMES) == 6


def test_a_bad_name_is_one_line_naming_the_field_and_the_choices():
    for given, problem in BAD:
        with pytest.raises(ConfigError) as error:
            tracker_names(given)
        assert error.value.field == "--report-to (train.report_to)"
        assert error.value.problem == problem
        assert "tensorboard, wandb, mlflow" in error.value.fix and "\n" not in str(error.value)
    assert len(BAD) == 4


def _without(monkeypatch, package: str) -> None:
    """Look-ups of `package` find nothing, as when it is not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch, name):
    _without(monkeypatch, name)
    check_trackers(("tensorboard",))  # the others are still fine
    with pytest.raises(ConfigError) as error:
        check_trackers(("tensorboard", f"{name},tensorboard"))
    assert str(error.value) == (
        f"--report-to {name} (train.report_to): the {name} package is not installed; "
        f'pip install "dataparallel[{name}]"'
    )


def test_the_cli_refuses_a_missing_package_before_anything_is_written(
    monkeypatch, capsys, tmp_path
):
    _without(monkeypatch, "wandb")
    out = tmp_path / "run"
    code = main(["train", "--report-to", "tensorboard,wandb", "--out", str(out)])
    assert code == 2
    assert capsys.readouterr().err == (
        "dataparallel train: error: --report-to wandb (train.report_to): the wandb package is "
        'not installed; pip install "dataparallel[wandb]"\n'
    )
    assert not out.exists()


def test_the_config_flattens_to_parameters(tmp_path):
    config = RunConfig().replace(train={"steps": 7}, data={"paths": ("a", "b")})
    params = flat_params(config, tmp_path)
    assert params["train.steps"] == 7 and params["data.paths"] == ["a", "b"]
    assert params["train.report_to"] == ["tensorboard"]
    assert params["run_dir"] == str(tmp_path.resolve())
    fields = sum(len(values) for values in config.to_dict().values())
    assert len(params) == fields + 1 == 61


class _Recorder:
    """A backend that keeps what it is sent."""

    sent: list = []

    def start(self, run_dir, *, purge_step):
        pass

    def log_scalars(self, values, step):
        _Recorder.sent.append((step, sorted(values)))

    def log_params(self, params):
        pass

    def finish(self, ok):
        pass


def test_train_steps_go_at_the_cadence_evaluations_always_and_the_last_at_the_end(
    tmp_path, monkeypatch
):
    """[Note: the trackers' cadence]: at every=3, of steps 1-8 and evaluations at 0 and 4, the
    backends get steps 1, 3, 6 and the last (8, sent when the writer stops) and both evaluations."""
    from dataparallel.train import trackers as module

    monkeypatch.setitem(module.BACKENDS, "recorder", _Recorder)
    _Recorder.sent = []
    trackers = module.Trackers(("recorder",), tmp_path, every=3)
    trackers.start(RunConfig(), purge_step=0)
    train = dict(kind="train", loss=1.0, lr=0.1, grad_norm=2.0, tokens_per_s=5.0)
    trackers.log_record({"kind": "val", "step": 0, "val_loss": 3.0})
    for step in range(1, 9):
        trackers.log_record({**train, "step": step})
        if step == 4:
            trackers.log_record({"kind": "val", "step": 4, "val_loss": 2.5})
    trackers.finish()
    assert [step for step, _ in _Recorder.sent] == [0, 1, 3, 4, 6, 8]
    assert [keys for step, keys in _Recorder.sent if step == 4] == [["val/loss"]]
    assert len(_Recorder.sent) == 6

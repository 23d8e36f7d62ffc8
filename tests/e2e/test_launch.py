"""`dataparallel launch SCRIPT`: a user's script under our launcher (tests/e2e/scripts/launched.py).

Checked from what each rank wrote: the world (ranks, world size, local ranks), the threads each
got ([Note: threads per worker]), the watchdog's timeout from --collective-timeout ([Note:
launcher settings] in runtime.py), one DDP step equal to one process's step on the whole batch,
a restart after a crash (--max-restarts 1: the script sees attempt 1 and resumes), and a hang
stopped by the watchdog. Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dataparallel.cli import main

from .helpers import cli

SCRIPT = Path(__file__).parent / "scripts" / "launched.py"
sys.path.insert(0, str(SCRIPT.parent))
import launched  # noqa: E402  (the script's own batch and model, for the reference step)


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return cli(["launch", *args], timeout=timeout)


def _ranks(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _reference_step() -> dict[str, torch.Tensor]:
    model = launched.reference_model()
    inputs, targets = launched.batch()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model.state_dict()


def test_runs_the_script_on_every_rank_with_our_settings(tmp_path):
    result = _launch(
        "--nproc", "2", "--threads", "1", "--collective-timeout", "42", str(SCRIPT), str(tmp_path)
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ranks = _ranks(tmp_path, 2)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1]
    assert {r["world_size"] for r in ranks} == {2}
    assert {r["threads"] for r in ranks} == {1} and {r["omp_num_threads"] for r in ranks} == {"1"}
    assert {r["collective_timeout"] for r in ranks} == {42.0}
    assert {r["attempt"] for r in ranks} == {0}
    # DDP's step on two halves equals one process's step on the whole batch.
    expected = _reference_step()
    for r in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(r["weights"][name]), value, rtol=1e-6, atol=0)


def test_fair_threads_by_default(tmp_path):
    from dataparallel.launch.workers import fair_threads

    result = _launch("--nproc", "2", str(SCRIPT), str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert {r["threads"] for r in _ranks(tmp_path, 2)} == {fair_threads(2)}
    # No --collective-timeout: the train default (300 s) reaches the script too.
    assert {r["collective_timeout"] for r in _ranks(tmp_path, 2)} == {300.0}


def test_a_crashed_worker_is_restarted_and_the_script_resumes(tmp_path):
    args = ["--nproc", "2", "--threads", "1", str(SCRIPT), str(tmp_path), "--crash-rank", "1"]
    failed = _launch("--max-restarts", "0", *args)
    assert failed.returncode == 1 and not (tmp_path / "rank0.json").exists()
    result = _launch("--max-restarts", "1", *args)
    assert result.returncode == 0, result.stderr
    ranks = _ranks(tmp_path, 2)
    assert [(r["attempt"], r["resumed_from"]) for r in ranks] == [(1, 7), (1, 7)]
    expected = _reference_step()
    for name, value in expected.items():
        torch.testing.assert_close(
            torch.tensor(ranks[1]["weights"][name]), value, rtol=1e-6, atol=0
        )


def test_the_watchdog_stops_a_hung_script(tmp_path):
    started = time.monotonic()
    result = _launch(
        "--nproc", "2", "--threads", "1", "--collective-timeout", "2",
        str(SCRIPT), str(tmp_path), "--hang-rank", "1",
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "collective timeout: rank 1 never arrived at" in output, output
    assert elapsed < 40


def test_a_stopped_worker_ends_the_launch_within_the_timeout_plus_10_s(tmp_path):
    """[Note: stopped workers]: the stopped rank takes the agent's SIGTERM at once."""
    timeout = 3
    started = time.monotonic()
    result = _launch(
        "--nproc", "2", "--threads", "1", "--collective-timeout", str(timeout),
        "--max-restarts", "0", str(SCRIPT), str(tmp_path), "--stop-rank", "1",
    )  # fmt: skip
    elapsed = time.monotonic() - started  # start-up (about 3 s) included
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "collective timeout: rank 1 " in output and "rank 1 is not responding" in output
    assert elapsed < timeout + 10, f"{elapsed:.1f} s\n{output}"


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["missing.py"], ["script: missing.py does not exist", "give a Python script"]),
        (["--nproc", "0", "S"], ["--nproc (launch.nproc): 0 is below 1"]),
        (["--collective-timeout", "-1", "S"], ["--collective-timeout", "below 0"]),
        (["--nnodes", "2", "S"], ["--rdzv-endpoint (launch.rdzv_endpoint)", "host:port"]),
        (["--node-rank", "1", "S"], ["--node-rank (launch.node_rank)", "use 0..0"]),
        (["--nproc", "two", "S"], ["argument --nproc: invalid int value"]),
    ],
)
def test_bad_input_is_one_line(args, fragments, capsys):
    args = [str(SCRIPT) if a == "S" else a for a in args]
    try:
        status = main(["launch", *args])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("dataparallel launch: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err

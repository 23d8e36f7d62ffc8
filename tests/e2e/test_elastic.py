"""Membership changes end to end (docs/faults.md, "Membership changes"): a live run of 2 workers
grows to 3 with `dataparallel join` and shrinks back to 2 with `dataparallel leave` of slot 0,
the writer of the run's records, without restarting anyone; every step is done once and the
weights are the uninterrupted run's.
"""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors.torch import load_file
from worker_pids import live_workers

from dataparallel.cli import main
from dataparallel.train.metrics import read_metrics

from .helpers import (
    CORPUS,
    GENERATION,
    LIVE_ARGS,
    LIVE_STEPS,
    WARM_JOINER,
    WarmPopen,
    numbers,
    ok,
    ranks_per_step,
    train_steps,
    wait_for,
)


def test_a_replica_joins_and_another_leaves_while_the_run_goes_on(tmp_path, capsys, live_reference):
    reference = live_reference  # uninterrupted, one rank (conftest.py)
    out, go = tmp_path / "live", tmp_path / "go"
    command = ["train", "--data", str(CORPUS), *LIVE_ARGS]
    command += ["--nproc", "2", "--batch", "6", "--min-replicas", "2", "--max-replicas", "3"]
    command += ["--recovery", "live", "--collective-timeout", "10", "--out", str(out)]
    launcher = WarmPopen(command)
    joiner = subprocess.Popen(
        [sys.executable, "-c", WARM_JOINER, str(go), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: any(s >= 3 for s in train_steps(out)), launcher, "step 3")
        first = live_workers(launcher.pid)
        go.touch()  # the third replica asks to join
        wait_for(lambda: 3 in ranks_per_step(out), launcher, "step with 3 ranks")
        assert main(["join", str(out)]) == 1  # a fourth is refused: --max-replicas 3
        assert main(["leave", str(out), "--replica", "0"]) == 0  # the writer
        wait_for(
            lambda: ranks_per_step(out)[-1] == 2, launcher, "step with 2 ranks after the leave"
        )
        assert main(["leave", str(out), "--replica", "2"]) == 1  # --min-replicas 2
        stdout, stderr = launcher.communicate(timeout=240)
        joined_out, joined_err = joiner.communicate(timeout=60)
    finally:
        for process in (launcher, joiner):
            if process.poll() is None:
                process.kill()
    ok(subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr))
    assert joiner.returncode == 0, joined_err
    said = capsys.readouterr()
    assert (
        "dataparallel join: refused: the run has 3 replica(s), its maximum (--max-replicas 3)"
        in said.err
    )
    assert "dataparallel leave: replica 0 leaves at its next step boundary" in said.out
    assert (
        "dataparallel leave: refused: --replica 2: 1 replica(s) would stay, fewer than "
        "--min-replicas 2" in said.err
    )
    assert "worker 0 left with status 0; not replaced" in stderr
    # The sizes 2 -> 3 -> 2, the same processes throughout: the two started, then the joiner.
    generations = [m.groups() for m in GENERATION.finditer(stderr)]
    members = [numbers(g[1]) for g in generations]
    assert members == [[0, 1], [0, 1, 2], [1, 2]], stderr
    pids = {s: p for g in generations for s, p in zip(numbers(g[1]), numbers(g[2]), strict=True)}
    assert pids == {**first, 2: joiner.pid}
    joined_at, left_at = int(generations[1][3]), int(generations[2][3])
    assert generations[1][4] == "2" and generations[2][4] is None  # the joiner healed, nobody else
    assert 3 <= joined_at < left_at < LIVE_STEPS
    sizes = ranks_per_step(out)  # by step: 2 ranks, then 3 from the join, then 2 from the leave
    assert sizes == [2] * joined_at + [3] * (left_at - joined_at) + [2] * (LIVE_STEPS - left_at)
    assert train_steps(out) == list(range(1, LIVE_STEPS + 1))  # every step once
    # The writer (slot 0) left: slot 1 took its role at the next record ([Note: the writer
    # role]): the evaluations are all there, and one report was printed, by slot 1.
    vals = [r["step"] for r in read_metrics(out) if r["kind"] == "val"]
    assert vals == [0, 25, 50, 75, 100] and stdout.count("dataparallel train: done") == 1
    assert not (out / "live.json").exists()  # nobody can join a run that has ended
    # The same samples in the same steps: equal up to summation order (2, 3, then 2 ranks).
    ours, theirs = (
        load_file(str(out / "model.safetensors")),
        load_file(str(reference / "model.safetensors")),
    )
    difference = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    # What a change costs the members: the time from the step before it to the step after it.
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ends = {r["step"]: r["elapsed_s"] for r in records if r["kind"] == "train"}
    gaps = sorted(ends[s + 1] - ends[s] for s in range(1, LIVE_STEPS))
    print(
        f"max |elastic - uninterrupted| = {difference:.2e}; joined at {joined_at} "
        f"({ends[joined_at + 1] - ends[joined_at]:.2f} s), left at {left_at} "
        f"({ends[left_at + 1] - ends[left_at]:.2f} s); median step {gaps[len(gaps) // 2]:.3f} s"
    )
    assert difference < 1e-4, difference

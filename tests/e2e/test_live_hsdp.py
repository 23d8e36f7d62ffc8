"""Live recovery of HSDP replicas end to end ([Note: HSDP replicas] in train/live/replica.py): ZeRO-2
inside replicas of 2 ranks (`--shard-group 2`), 2 replicas; one rank of replica 1 killed with
SIGKILL. Its sibling is killed with it (a replica is a failure domain), replica 0 goes on in
the same two processes, a new replica of two processes is healed from it shard by shard; then
replica 0, the writer's, leaves (`dataparallel leave`) and the new replica finishes the run.
Every step is done once, and the weights are the uninterrupted run's up to summation order.
"""

from __future__ import annotations

import os
import signal
import subprocess

from safetensors.torch import load_file
from worker_pids import live_ranks

from dataparallel.cli import main
from dataparallel.train.metrics import read_metrics

from .helpers import (
    CORPUS,
    GENERATION,
    LIVE_ARGS,
    LIVE_STEPS,
    WarmPopen,
    numbers,
    ok,
    ranks_per_step,
    told_on_failure,
    train_steps,
    wait_for,
)

HSDP = ["--nproc", "4", "--shard-group", "2", "--strategy", "zero2", "--batch", "3"]
WAIT_S = 180  # for each stage of the run


def test_a_rank_killed_loses_its_replica_which_is_healed_shard_by_shard(tmp_path, live_reference):
    reference = live_reference  # the same global batch on one rank, uninterrupted (conftest.py)
    command = ["train", "--data", str(CORPUS), *LIVE_ARGS]
    out = tmp_path / "live"
    live = [*command, *HSDP, "--recovery", "live", "--collective-timeout", "10"]
    launcher = WarmPopen([*live, "--out", str(out)])
    with told_on_failure(launcher):
        wait_for(lambda: any(s >= 3 for s in train_steps(out)), launcher, "step 3", WAIT_S)
        before = live_ranks(launcher.pid)
        os.kill(before[1, 1], signal.SIGKILL)  # one rank of replica 1

        def replaced() -> bool:
            now = live_ranks(launcher.pid)
            return all(now.get((1, i), before[1, i]) != before[1, i] for i in (0, 1))

        # its sibling killed with it
        wait_for(replaced, launcher, "replica 1's replacement", WAIT_S)
        started = train_steps(out)[-1]
        wait_for(
            lambda: train_steps(out)[-1] > started + 2 and ranks_per_step(out)[-1] == 4,
            launcher,
            "steps with the new replica",
            WAIT_S,
        )
        after = live_ranks(launcher.pid)
        assert main(["leave", str(out), "--replica", "0"]) == 0  # the writer's replica leaves
        stdout, stderr = launcher.communicate(timeout=240)
    ok(subprocess.CompletedProcess(live, launcher.returncode, stdout, stderr))
    # Replica 0's two processes went on; replica 1 is two new ones (the sibling was killed too).
    assert {k: after[k] for k in [(0, 0), (0, 1)]} == {k: before[k] for k in [(0, 0), (0, 1)]}
    assert not {after[1, 0], after[1, 1]} & set(before.values())
    generations = [m.groups() for m in GENERATION.finditer(stderr)]
    assert numbers(generations[0][1]) == [0, 1], stderr
    # Usually replica 0 trains alone first; when its ranks waited for replica 1's survivor
    # until the collective timeout, the replacement was healed in generation 1 already.
    _, members, _, joined_at, healed = next(g for g in generations if g[4])
    assert numbers(members) == [0, 1] and numbers(healed) == [1], stderr
    assert numbers(generations[-1][1]) == [1], stderr  # replica 0 left: the new one goes on
    assert "worker 0 left with status 0; not replaced" in stderr
    sizes = ranks_per_step(out)  # 4 ranks (maybe replica 0's 2), 4 again, replica 1's 2
    assert sizes[0] == 4 and 4 in sizes[1:] and sizes[-1] == 2 and set(sizes) <= {2, 4}, sizes
    assert train_steps(out) == list(range(1, LIVE_STEPS + 1))  # every step once
    vals = [r["step"] for r in read_metrics(out) if r["kind"] == "val"]
    assert vals == [0, 25, 50, 75, 100] and stdout.count("dataparallel train: done") == 1
    ours, theirs = (
        load_file(str(out / "model.safetensors")),
        load_file(str(reference / "model.safetensors")),
    )
    difference = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    print(f"max |live HSDP - uninterrupted| = {difference:.2e}, healed at step {joined_at}")
    assert difference < 1e-4, difference

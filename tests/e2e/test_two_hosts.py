"""Two hosts on a shaped 100 Mbit/s link (network namespaces, tests/host_namespaces.py): the real
`dataparallel train --nnodes 2`, exact and int8-compressed, one node per namespace.

Checks: both nodes finish; the link really is slow (an exact step of gpt-tiny moves 4.2 MB per
rank, at least 0.34 s at 100 Mbit/s); int8 sends under 40% of the exact bytes and trains to a
validation loss within 2% of the exact run's; the namespaces are gone afterwards, also after a
run whose workers fail; a worker killed on the second host restarts both hosts' workers from
the latest checkpoint and the run ends bit-identical to an uninterrupted one (restart mode);
in live mode a replica joined from the second host and killed there leaves worker 0 training
in the same process, and the second host's keeper (`join --restarts`) joins a new replica that
is healed over the link.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import host_namespaces
import pytest
from safetensors.torch import load_file
from worker_pids import children, live_workers, workers_by_rank

from dataparallel.checkpoint import complete_checkpoints, step_name
from dataparallel.train.metrics import read_metrics
from dataparallel.train.run_dir import CHECKPOINTS

from .helpers import (
    CORPUS,
    GENERATION,
    LIVE_ARGS,
    LIVE_STEPS,
    WARM_JOINER,
    numbers,
    ranks_per_step,
    start_warm,
    train_steps,
    wait_for,
)

REASON = host_namespaces.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two hosts: {REASON}")
# A keeper of the second host's replica (`join --restarts 1`), torch imported, that starts once
# `go` exists: the test decides when it joins, not the time this machine takes to import torch.
WARM_KEEPER = WARM_JOINER.replace(
    '["join", sys.argv[2]]', '["join", sys.argv[2], "--restarts", "1"]'
)
ARGS = ["--model", "gpt-tiny", "--steps", "6", "--eval-every", "0", "--threads", "1",
        "--checkpoint-every", "3"]  # fmt: skip


def _train(out: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    node0, node1, output, _ = host_namespaces.train_on_two_hosts(
        [*ARGS, *extra], str(out), start=start_warm
    )
    assert (node0, node1) == (0, 0), output
    return _records(out)


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory) -> Path:
    """The exact run on the shaped link (also the killed run's reference: the shaping changes
    no number)."""
    out = tmp_path_factory.mktemp("two-hosts") / "exact"
    _train(out)
    assert len(host_namespaces.MADE) >= 2  # two hosts were made here, and were removed:
    assert host_namespaces.leftover() == set()
    return out


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "val"]


def test_exact_and_int8_training_across_two_namespaces(exact_run, tmp_path):
    exact, exact_val = _records(exact_run)
    int8, int8_val = _train(tmp_path / "int8", "--compress", "int8")
    assert host_namespaces.leftover() == set()  # everything created was removed
    exact_bytes = statistics.median(r["bytes_sent"] for r in exact)
    int8_bytes = statistics.median(r["bytes_sent"] for r in int8)
    assert exact_bytes > 4.2e6  # 1.06M fp32 gradients all-reduced
    assert int8_bytes < 0.4 * exact_bytes
    # The shaping works: 4.2 MB cannot cross 100 Mbit/s in under 0.34 s.
    assert statistics.median(r["step_time_s"] for r in exact[1:]) > 0.34
    assert int8_val[-1]["val_loss"] < exact_val[-1]["val_loss"] * 1.02


def test_a_failed_run_leaves_no_namespace(tmp_path):
    node0, node1, output, _ = host_namespaces.train_on_two_hosts(
        [*ARGS, "--compress", "topk:ratio=2"], str(tmp_path / "bad"), start=start_warm
    )
    assert node0 == node1 == 2 and "ratio=2.0 must be in (0, 1]" in output
    assert host_namespaces.leftover() == set()


def _kill_when(run: Path, step: int, caught: list):
    """A `during` for two_hosts: once the metrics show `step` and the checkpoint of the step
    before is committed (a save may still be in flight when the next step's record is written:
    a kill before its commit resumed from scratch, once in four full suites), SIGKILL the worker
    on the second host (the child of node 1's launcher with RANK 1); its pid goes into `caught`."""
    saved = run / CHECKPOINTS / step_name(step - 1)

    def kill(procs):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            reached = any(r.get("step", 0) >= step for r in read_metrics(run))  # whole lines
            if reached and saved in complete_checkpoints(run / CHECKPOINTS):
                victim = workers_by_rank(procs[1].pid).get(1)
                if victim:
                    os.kill(victim, signal.SIGKILL)
                    caught.append(victim)
                    return
            time.sleep(0.05)

    return kill


def test_a_worker_killed_on_the_second_host_restarts_both_and_loses_nothing(exact_run, tmp_path):
    """Restart mode across hosts: node 1's worker is killed after step 4; both agents restart
    their workers (the c10d rendezvous spans the namespaces), which resume from step 3's
    checkpoint; the final weights equal the uninterrupted run's bit for bit."""
    killed, caught = tmp_path / "killed", []
    node0, node1, output, _ = host_namespaces.train_on_two_hosts(
        ARGS, str(killed), rate=None, during=_kill_when(killed, 4, caught), start=start_warm
    )
    assert (node0, node1) == (0, 0), output
    assert caught, "the worker on the second host was never found"
    assert "resumed at step 3 of 6" in output  # the restarted workers loaded the checkpoint
    want = load_file(exact_run / "model.safetensors")
    got = load_file(killed / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(want[k].equal(got[k]) for k in want)


def test_live_across_two_hosts_a_replica_killed_on_the_second_is_joined_again(
    live_reference, tmp_path
):
    """Live mode across hosts: the launcher and worker 0 on the first host, a replica joining
    from the second (`dataparallel join --restarts 1`, its store at the first host's address).
    The joined replica is killed with SIGKILL: worker 0 goes on alone in the same process, and
    the second host's keeper joins a new replica by itself, healed over the link ([Note: the
    machine's keeper] in train/live/elastic.py); every step is done once and the weights are the
    uninterrupted run's up to summation order."""
    out = tmp_path / "live"
    train = [sys.executable, "-m", "dataparallel.cli", "train", "--data", str(CORPUS), *LIVE_ARGS]
    train += ["--nproc", "1", "--batch", "12", "--max-replicas", "2", "--recovery", "live"]
    train += ["--collective-timeout", "10", "--store-host", host_namespaces.ADDRESSES[0]]
    train += ["--out", str(out)]
    go = tmp_path / "go"
    with host_namespaces.linked_namespaces(rate=None) as nodes:

        def start(node: int, argv: list[str]) -> subprocess.Popen:
            space, link, _ = nodes[node]
            env = dict(os.environ, GLOO_SOCKET_IFNAME=link, PYTHONUNBUFFERED="1")
            return subprocess.Popen(["ip", "netns", "exec", space, *argv], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

        launcher = start_warm(nodes[0][0], train, dict(os.environ, GLOO_SOCKET_IFNAME=nodes[0][1]))
        keeper = start(1, [sys.executable, "-c", WARM_KEEPER, str(go), str(out)])
        try:
            wait_for(lambda: any(s >= 3 for s in train_steps(out)), launcher, "step 3")
            survivor = live_workers(launcher.pid)[0]
            go.touch()  # the second host's keeper joins its first replica
            wait_for(lambda: ranks_per_step(out).count(2) >= 3, launcher, "3 steps with 2 ranks")
            (replica,) = children(keeper.pid, deep=False)
            os.kill(replica, signal.SIGKILL)  # on the second host
            stdout, stderr = launcher.communicate(timeout=240)
            _, kept = keeper.communicate(timeout=60)
        finally:
            for process in (launcher, keeper):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert launcher.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert keeper.returncode == 0, kept
    assert "the replica was lost (status -9); joining again (1 of --restarts 1)" in kept
    generations = [m.groups() for m in GENERATION.finditer(stderr)]
    assert [numbers(g[1]) for g in generations] == [[0], [0, 1], [0], [0, 2]], stderr
    assert {int(p) for g in generations for p in numbers(g[2])[:1]} == {survivor}
    sizes = ranks_per_step(out)
    assert 2 in sizes and sizes[-1] == 2  # the keeper's second replica trained to the end
    assert train_steps(out) == list(range(1, LIVE_STEPS + 1))  # every step once
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(live_reference / "model.safetensors"))
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-4

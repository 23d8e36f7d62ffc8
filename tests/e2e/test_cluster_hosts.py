"""Two nodes started as a scheduler starts them (network namespaces, tests/host_namespaces.py):
`dataparallel train` on each host with no node flags, only the variables that srun sets for one
task per node (SLURM_*), and again those of Kubeflow Trainer (PET_*); each forms one run of 2
workers whose final weights equal a one-host run of the same global batch, bit for bit, and
each launcher prints the topology it resolved (launch/environments.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import host_namespaces
import pytest
from safetensors.torch import load_file

from .helpers import cli, ok, start_warm

REASON = host_namespaces.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two hosts: {REASON}")
ARGS = ["--model", "gpt-tiny", "--steps", "3", "--eval-every", "0", "--threads", "1",
        "--checkpoint-every", "3", "--batch", "4"]  # fmt: skip
JOB = 4242  # the Slurm job id: rank 0's port is 15000 + 4242


def slurm_variables(node: int) -> list[str]:
    """What srun sets in the one task of node `node` of a two-node step (nodes by address)."""
    hosts = "10.77.0.[1-2]"
    return [f"SLURM_JOB_ID={JOB}", "SLURM_NNODES=2", f"SLURM_JOB_NODELIST={hosts}",
            "SLURM_STEP_ID=0", "SLURM_STEP_NUM_NODES=2", "SLURM_STEP_NUM_TASKS=2",
            f"SLURM_STEP_NODELIST={hosts}", "SLURM_STEP_TASKS_PER_NODE=1(x2)",
            f"SLURM_PROCID={node}", "SLURM_LOCALID=0", f"SLURM_NODEID={node}"]  # fmt: skip


def pet_variables(node: int) -> list[str]:
    """What Kubeflow Trainer's torch runtime sets in node `node`'s pod."""
    return ["PET_NNODES=2", "PET_NPROC_PER_NODE=1", f"PET_NODE_RANK={node}",
            f"PET_MASTER_ADDR={host_namespaces.ADDRESSES[0]}", "PET_MASTER_PORT=29517"]  # fmt: skip


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one-host") / "run"
    ok(cli(["train", "--nproc", "2", *ARGS, "--out", str(out)]))
    return out


@pytest.mark.parametrize(
    "variables,line",
    [
        (slurm_variables, "slurm, one task per node: node {node} of 2, 1 worker each (world 2), "
         "rank 0 at 10.77.0.1:19242"),
        (pet_variables, "kubeflow: node {node} of 2, 1 worker each (world 2), "
         "rank 0 at 10.77.0.1:29517"),
    ],
    ids=["slurm", "kubeflow"],
)  # fmt: skip
def test_two_nodes_from_the_schedulers_variables_equal_one_host(
    one_host, tmp_path, variables, line
):
    out = tmp_path / "run"

    def command(node_rank: int, link: str) -> list[str]:
        return ["env", *variables(node_rank), sys.executable, "-m", "dataparallel.cli", "train",
                "--nproc", "1", *ARGS, "--out", str(out)]  # fmt: skip

    node0, node1, output, _ = host_namespaces.run_on_two_hosts(
        command, rate=None, timeout=600, start=start_warm
    )
    assert (node0, node1) == (0, 0), output
    for node in (0, 1):
        assert f"dataparallel train: {line.format(node=node)}" in output
    want, got = load_file(one_host / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(want[k].equal(got[k]) for k in want)

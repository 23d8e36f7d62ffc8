"""Cluster environments (launch/environments.py, launch/hostlist.py): detection, precedence, the
topology each one resolves and each one-line refusal, from plain dicts (no process started).

The Slurm variables are those srun sets (slurm-wlm 22.05, checked in benchmarks/slurm_trial.py).
"""

import pytest

from dataparallel.launch.config import ConfigError
from dataparallel.launch.environments import Kubeflow, OpenMPI, Torchrun, detect
from dataparallel.launch.hostlist import expand_hostlist, expand_tasks_per_node
from dataparallel.launch.slurm import SLURM_PORT_BASE, SlurmTaskPerNode, SlurmTaskPerWorker

HOSTLISTS = [
    ("node1", ["node1"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("a,b[9-10],c", ["a", "b9", "b10", "c"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
]


@pytest.mark.parametrize("text,hosts", HOSTLISTS)
def test_hostlist_expands_as_scontrol_does(text, hosts):
    assert expand_hostlist(text) == hosts


def test_hostlist_cases_count():
    assert len(HOSTLISTS) == 7


@pytest.mark.parametrize("text", ["node[1-", "node[3-1]", "node[a-b]", "a,,b", "n]1["])
def test_a_bad_hostlist_is_one_line_naming_the_variable(text, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # no scontrol to fall back on
    with pytest.raises(ConfigError) as error:
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    assert str(error.value).startswith("SLURM_STEP_NODELIST: ")
    assert "\n" not in str(error.value)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
        expand_tasks_per_node("2(xx)")


def slurm_step(procid, ntasks, nnodes, tasks_per_node, **extra):
    """What srun sets in one task of job 4242 on nodes n[1-N]."""
    per = ntasks // nnodes
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_NODELIST": f"n[1-{nnodes}]",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NODELIST": f"n[1-{nnodes}]",
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % per),
        "SLURM_NODEID": str(procid // per),
        **extra,
    }


def test_slurm_one_task_per_node():
    env = slurm_step(1, ntasks=2, nnodes=2, tasks_per_node="1(x2)")
    environment = detect(env)
    assert isinstance(environment, SlurmTaskPerNode)
    topology = environment.topology(None, default=3)
    assert (topology.worker, topology.nnodes, topology.node_rank, topology.nproc) == (
        False,
        2,
        1,
        3,
    )
    assert topology.launch_fields() == {
        "nproc": 3,
        "nnodes": 2,
        "node_rank": 1,
        "rdzv_endpoint": f"n1:{SLURM_PORT_BASE + 4242}",
    }
    assert topology.describe() == (
        f"slurm, one task per node: node 1 of 2, 3 workers each (world 6), rank 0 at "
        f"n1:{SLURM_PORT_BASE + 4242}"
    )


def test_slurm_one_task_per_worker():
    env = slurm_step(3, ntasks=4, nnodes=2, tasks_per_node="2(x2)", MASTER_PORT="23456")
    environment = detect(env)
    assert isinstance(environment, SlurmTaskPerWorker)
    topology = environment.topology(None)
    assert topology.worker_variables() == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "23456",
    }
    assert topology.describe().startswith("slurm, one task per worker: rank 3 of world 4")


def test_slurm_batch_script_of_one_node_runs_our_launcher():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "vm"}
    topology = detect(env).topology(4)
    assert (topology.worker, topology.nnodes, topology.nproc) == (False, 1, 4)
    assert topology.launch_fields() == {"nproc": 4, "nnodes": 1, "node_rank": 0}


def test_torchrun_wins_over_slurm():
    env = slurm_step(0, ntasks=2, nnodes=2, tasks_per_node="1(x2)")
    env.update(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1")
    env.update(MASTER_ADDR="n1", MASTER_PORT="29500")
    environment = detect(env)
    assert isinstance(environment, Torchrun)
    topology = environment.topology(None)
    assert (topology.worker, topology.rank, topology.nnodes, topology.nproc) == (True, 5, 2, 4)


def test_ray_sets_node_rank_not_group_rank():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env.update(NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")
    topology = detect(env).topology(None)
    assert (topology.node_rank, topology.nnodes, topology.main_address) == (1, 2, "10.0.0.1")


def test_mpi_wins_over_slurm_and_reads_master_addr():
    env = slurm_step(0, ntasks=2, nnodes=2, tasks_per_node="1(x2)")
    env.update(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3")
    env.update(OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="h0")
    environment = detect(env)
    assert isinstance(environment, OpenMPI)
    topology = environment.topology(None)
    assert (topology.rank, topology.node_rank, topology.main_port) == (3, 1, 29500)


def test_kubeflow_pet_contract():
    env = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "2"}
    env.update(PET_MASTER_ADDR="job-node-0-0.job", PET_MASTER_PORT="29400")
    environment = detect(env)
    assert isinstance(environment, Kubeflow)
    assert environment.topology(None).launch_fields() == {
        "nproc": 2,
        "nnodes": 3,
        "node_rank": 2,
        "rdzv_endpoint": "job-node-0-0.job:29400",
    }
    env["PET_NPROC_PER_NODE"] = "auto"
    assert detect(env).topology(None, default=5).nproc == 5


def test_nothing_detected_leaves_the_flags():
    assert detect({"HOME": "/root", "MASTER_ADDR": "x"}) is None


PET_MAIN = {"PET_MASTER_ADDR": "h0", "PET_MASTER_PORT": "29400"}

# Each refusal: (environment variables, --nproc asked, the variable named, words of the line).
REFUSALS = [
    (  # tasks per node that do not match the workers asked for
        slurm_step(0, ntasks=4, nnodes=2, tasks_per_node="2(x2)"),
        4,
        "SLURM_STEP_TASKS_PER_NODE",
        "--ntasks-per-node",
    ),
    (  # uneven tasks per node
        slurm_step(0, ntasks=3, nnodes=2, tasks_per_node="2,1"),
        None,
        "SLURM_STEP_TASKS_PER_NODE",
        "different numbers of tasks",
    ),
    (  # the batch script of a two-node job, without srun
        {"SLURM_JOB_ID": "9", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"},
        None,
        "SLURM_STEP_ID",
        "srun --ntasks-per-node=1",
    ),
    (
        {"PET_NNODES": "1:4", "PET_NODE_RANK": "0"},
        None,
        "PET_NNODES",
        "elastic range",
    ),
    (
        {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_PORT": "1"},
        None,
        "PET_MASTER_ADDR",
        "is not set",
    ),
    (
        {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "2"} | PET_MAIN,
        None,
        "PET_NODE_RANK",
        "not below the 2 nodes",
    ),
    (
        {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "0"} | PET_MAIN,
        2,
        "PET_NPROC_PER_NODE",
        "--nproc 2",
    ),
    (
        {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h"},
        None,
        "LOCAL_WORLD_SIZE",
        "does not divide",
    ),
    (
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"},
        None,
        "MASTER_ADDR",
        "is not set",
    ),
    (
        {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
        | {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        None,
        "MASTER_ADDR",
        "mpirun -x MASTER_ADDR",
    ),
    (
        slurm_step(0, ntasks=2, nnodes=2, tasks_per_node="1(x2)", SLURM_JOB_ID="x1"),
        None,
        "SLURM_JOB_ID",
        "not a whole number",
    ),
]


@pytest.mark.parametrize("env,asked,variable,words", REFUSALS)
def test_each_refusal_is_one_line_naming_the_variable_and_the_fix(env, asked, variable, words):
    with pytest.raises(ConfigError) as error:
        detect(env).topology(asked)
    line = str(error.value)
    assert error.value.field == variable
    assert line.startswith(f"{variable}: ") and words in line and "\n" not in line
    assert error.value.fix


def test_refusal_cases_count():
    assert len(REFUSALS) == 11


def test_train_refuses_a_bad_allocation_on_one_line(monkeypatch, capsys):
    from dataparallel.cli import main

    for name, value in REFUSALS[2][0].items():  # a two-node batch script, without srun
        monkeypatch.setenv(name, value)
    assert main(["train", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "dataparallel train: error: SLURM_STEP_ID: not set: this is the job's batch script, not "
        "a task of srun, on 2 nodes; start it as srun --ntasks-per-node=1 dataparallel train ...\n"
    )


def test_train_takes_the_launch_fields_from_the_environment(monkeypatch, capsys):
    from dataparallel.cli import main

    for name, value in ({"PET_NNODES": "3", "PET_NODE_RANK": "1"} | PET_MAIN).items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--nproc", "4", "--print-config"]) == 0
    printed = capsys.readouterr().out
    for line in ("nproc = 4", "nnodes = 3", "node_rank = 1", 'rdzv_endpoint = "h0:29400"'):
        assert line in printed.splitlines()

"""`dataparallel cluster slurm|k8s ARGS...` (launch/jobfiles.py, launch/cluster_command.py): the
printed sbatch lines and the manifest's structure (parsed with PyYAML), and the one-line
refusals. The sbatch script itself runs under a real Slurm in benchmarks/slurm_trial.py."""

import shlex

import pytest
import yaml

from dataparallel.cli import main
from dataparallel.launch.cluster_command import job_spec
from dataparallel.launch.config import ConfigError
from dataparallel.launch.jobfiles import k8s_manifest, slurm_script


def printed(capsys, *args):
    assert main(["cluster", *args]) == 0
    return capsys.readouterr().out


def sbatch_options(text):
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line[:7] == "#SBATCH"]


def test_slurm_one_task_per_node(capsys):
    text = printed(
        capsys, "slurm", "--nodes", "2", "--nproc", "4", "--steps", "9", "--time", "1:00:00"
    )
    assert sbatch_options(text) == [
        "--job-name=dataparallel",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=1:00:00",
        "--signal=B:USR1@90",
        "--requeue",
        "--open-mode=append",
        "--output=dataparallel-%j.out",
    ]
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert (
        lines[1]
        == "# Printed by: dataparallel cluster slurm --nodes 2 --nproc 4 --steps 9 --time 1:00:00"
    )
    assert "# Assumed:" in lines
    # One command at every start: --resume auto begins the run or resumes it.
    assert (
        "srun --ntasks-per-node=1 dataparallel train --steps 9 --nproc 4 --out runs/dataparallel "
        "--resume auto &"
    ) in lines
    assert not any("config.toml" in line for line in lines)
    assert "trap 'kill -USR1 \"$step\" 2>/dev/null' USR1  # srun passes it to the tasks" in lines
    # Requeued on the step's PREEMPTED status only; any other status is the job's.
    requeue = lines.index('  scontrol requeue "$SLURM_JOB_ID"')
    assert lines[requeue - 2].startswith('if [ "$status" = 75 ]; then')
    assert lines[requeue + 1 :] == ["fi", 'exit "$status"']
    # Every #SBATCH line comes before the first command, or sbatch ignores it.
    first_command = next(i for i, line in enumerate(lines) if line and line[0] != "#")
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command


def test_slurm_one_task_per_worker_and_the_options():
    spec = job_spec(
        shlex.split(
            "--layout worker --nodes 3 --nproc 2 --cpus-per-node 8 --gpus-per-node 2 "
            "--partition gpu --name tiny --out /shared/r --setup 'module load py' "
            "--program 'python -m dataparallel.cli' --signal-s 120 --model gpt-tiny"
        )
    )
    text = slurm_script(spec, "x")
    assert sbatch_options(text)[:6] == [
        "--job-name=tiny",
        "--nodes=3",
        "--ntasks-per-node=2",
        "--cpus-per-task=4",
        "--gpus-per-node=2",
        "--partition=gpu",
    ]
    assert "--signal=B:USR1@120" in sbatch_options(text)
    lines = text.splitlines()
    assert "module load py" in lines
    assert (
        "srun --ntasks-per-node=2 python -m dataparallel.cli train --model gpt-tiny --nproc 2 "
        "--out /shared/r --resume auto &"
    ) in lines


def test_k8s_manifest_structure(capsys):
    text = printed(capsys, "k8s", "--nodes", "2", "--nproc", "3", "--cpus-per-node", "6",
                   "--image", "reg/dp:1", "--claim", "runs", "--name", "tiny", "--steps", "5")  # fmt: skip
    assert text.startswith("# Printed by: dataparallel cluster k8s --nodes 2")
    runtime, job = yaml.safe_load_all(text)
    assert (runtime["kind"], job["kind"]) == ("TrainingRuntime", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "tiny-runtime"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {"numProcPerNode": 3}}
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"]["rules"] == [
        {
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ]
    node = jobset["replicatedJobs"][0]["template"]["spec"]
    # The container's PREEMPTED exit (it saved its step) is a disruption like DisruptionTarget.
    assert node["podFailurePolicy"]["rules"] == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "node", "operator": "In", "values": [75]},
        },
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
    ]
    pod = node["template"]["spec"]
    assert (pod["restartPolicy"], pod["terminationGracePeriodSeconds"]) == ("Never", 90)
    (container,) = pod["containers"]
    assert container["image"] == "reg/dp:1"
    assert container["resources"]["requests"] == {"cpu": 6}
    assert container["volumeMounts"] == [{"name": "runs", "mountPath": "/runs"}]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "runs"}
    assert container["command"] == [
        "/bin/sh",
        "-c",
        "exec dataparallel train --steps 5 --nproc 3 --out /runs/tiny --resume auto",
    ]


# (ARGS, the field named); each refusal is one line.
REFUSALS = [
    (["--resume", "runs/x"], "--resume"),
    (["--nnodes=2"], "--nnodes"),
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "two"], "--nodes"),
    (["--layout", "task"], "--layout"),
    (["--name", "a b"], "--name"),
    (["--layout", "worker", "--nproc", "3", "--cpus-per-node", "8"], "--cpus-per-node"),
    (["--resume=auto"], "--resume"),
    (["--signal-s", "29"], "--signal-s"),
    (["--signal-s", "60", "--preempt-budget", "56"], "--signal-s"),
    (["--preempt-budget=soon"], "--preempt-budget"),
]


@pytest.mark.parametrize("args,field", REFUSALS)
def test_refusals(args, field):
    with pytest.raises(ConfigError) as error:
        slurm_script(job_spec(args), "x")
    assert error.value.field == field and "\n" not in str(error.value)


def test_refusal_cases_count():
    assert len(REFUSALS) == 11


def test_grace_holds_the_preempt_budget(capsys):
    """--signal-s must hold --preempt-budget (25 s unless given) plus 5 s, naming both."""
    assert main(["cluster", "k8s", "--signal-s", "40", "--preempt-budget", "36"]) == 2
    assert capsys.readouterr().err == (
        "dataparallel cluster: error: --signal-s: 40 s does not hold --preempt-budget 36 s plus "
        "5 s; give --signal-s 41 or more, or a smaller --preempt-budget\n"
    )
    assert job_spec(["--signal-s", "30"]).preempt_budget_s == 25.0
    spec = job_spec(["--signal-s", "40", "--preempt-budget=35", "--steps", "3"])
    assert spec.preempt_budget_s == 35.0 and "--preempt-budget=35" in spec.train_args
    pod = list(yaml.safe_load_all(k8s_manifest(spec, "x")))[0]["spec"]["template"]["spec"]
    grace = pod["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert grace["terminationGracePeriodSeconds"] == 40
    assert "--signal=B:USR1@40" in sbatch_options(slurm_script(spec, "x"))


def slurm_env(monkeypatch, tasks: int):
    """The variables srun sets in task 0 of a one-node job with `tasks` tasks."""
    for name in ("RANK", "WORLD_SIZE", "PET_NNODES", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = {"SLURM_JOB_ID": "31", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "vm",
           "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": str(tasks),
           "SLURM_NTASKS": str(tasks), "SLURM_STEP_NODELIST": "vm",
           "SLURM_STEP_TASKS_PER_NODE": str(tasks), "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("layout,tasks", [("node", 1), ("worker", 2)])
def test_the_printed_command_resolves_under_slurm(capsys, monkeypatch, tmp_path, layout, tasks):
    """srun's line, `train ... --resume auto`, resolves in a task before the run exists (a
    topology was once resolved with --resume auto read as a run directory)."""
    out = tmp_path / "run"
    text = printed(capsys, "slurm", "--layout", layout, "--out", str(out), "--steps", "3")
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    argv = shlex.split(srun.removesuffix(" &"))
    train = argv[argv.index("train") :]
    assert train[-2:] == ["--resume", "auto"]
    slurm_env(monkeypatch, tasks)
    assert main([*train, "--print-config"]) == 0
    config = capsys.readouterr().out
    assert f'out = "{out}"' in config and "steps = 3" in config
    assert not out.exists()


def test_k8s_has_no_worker_layout(capsys):
    assert main(["cluster", "k8s", "--layout", "worker"]) == 2
    assert capsys.readouterr().err == (
        "dataparallel cluster: error: --layout: worker is Slurm's; leave --layout out for k8s\n"
    )
    with pytest.raises(ConfigError):
        k8s_manifest(job_spec(["--layout", "worker"]), "x")


def test_docs_show_the_script_as_printed(capsys):
    """docs/clusters.md's example is what the command prints today."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "clusters.md").read_text()
    shown = docs.split("```bash\n", 1)[1].split("```", 1)[0]
    args = shlex.split(shown.splitlines()[1].removeprefix("# Printed by: dataparallel cluster "))
    assert printed(capsys, *args) == shown


def test_yaml_lines_read_back_as_the_dict():
    """The manifest is built as a dict and written by `yaml_lines`: YAML reads back the same
    values, also for strings that bare YAML would read as something else."""
    from dataparallel.launch.jobfiles import yaml_lines

    tricky = ["true", "123", "1e-3", "no", "a: b", "#x", "it's", 'say "hi"', "", "/bin/sh"]
    data = {
        "plain": "trainer.kubeflow.org/v1alpha1",
        "numbers": {"int": 3, "negative": -1, "float": 2.5, "bool": True},
        "tricky": {f"k{i}": value for i, value in enumerate(tricky)},
        "flow": [*tricky, 75],
        "blocks": [{"name": "a", "inner": {"x": [1, 2]}}, {"only": {"deep": {"er": "y"}}}],
        "nvidia.com/gpu": 1,
    }
    assert yaml.safe_load("\n".join(yaml_lines(data))) == data
    spec = job_spec(["--name", "true", "--gpus-per-node", "1"])
    runtime, job = yaml.safe_load_all(k8s_manifest(spec, "x"))
    assert job["metadata"]["name"] == "true"  # a string, not YAML's boolean

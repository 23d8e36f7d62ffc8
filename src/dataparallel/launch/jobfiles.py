"""Job files that run `dataparallel train` on a scheduler: an sbatch script, a Kubeflow TrainJob.

`dataparallel cluster slurm|k8s ARGS...` (cluster_command.py) prints them. Each says in its
first lines what it assumed, and each runs one command, `dataparallel train ARGS --out RUN_DIR
--resume auto`, in one shared run directory: the first start begins the run, a requeued or
restarted one resumes it from its latest checkpoint.

[Note: requeue] Slurm requeues a job only when asked (`scontrol requeue`, from the script) and
Kubernetes restarts a TrainJob's pods only when a failure policy says so. A preempted run saves
its step and exits with PREEMPTED ([Note: preemption] in preemption.py), and the job files
requeue on that status:
- The sbatch script asks Slurm for USR1 `signal_s` seconds before the time limit
  (`--signal=B:USR1@S`, to the batch shell), forwards it to the job step (srun passes it to
  the tasks), waits for the step to end and, when its status is PREEMPTED, requeues the job;
  any other status is the job's.
- The manifest's pod failure policy fails the node's Job on a disruption (preemption, eviction:
  the pod's DisruptionTarget condition) and on the container's exit with PREEMPTED, and the
  JobSet restarts every node on that failure without counting it against its restarts.
- Either way the grace (`signal_s`: the warning before Slurm's time limit, the pod's
  terminationGracePeriodSeconds) must hold the save: `--preempt-budget` plus GRACE_MARGIN_S.
The next start resumes from the checkpoint written at the signal; nothing is redone.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from .config import ConfigError
from .preemption import DEFAULT_BUDGET_S, PREEMPTED

# Seconds of grace beyond --preempt-budget: the signal's way to the workers and the exits.
GRACE_MARGIN_S = 5


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What a printed job file runs and asks for.

    name: the job's name (sbatch --job-name, the TrainJob's name), also the run directory's.
    nodes: machines in the job.
    nproc: workers on each node (the train command's --nproc).
    layout: Slurm only. "node": one task per node, our launcher starts its nproc workers;
        "worker": one task per worker (--ntasks-per-node=nproc), each task trains in place.
    run_dir: the run directory, on a file system every node shares; empty: runs/<name> (Slurm:
        under the directory sbatch is run from) or /runs/<name> (Kubernetes: the volume).
    train_args: the arguments of `dataparallel train` other than --nproc, --out and --resume.
    preempt_budget_s: the train command's --preempt-budget (read from train_args): the grace
        `signal_s` must hold.
    program: how the nodes start dataparallel ("dataparallel", "python -m dataparallel.cli").
    setup: a shell line run before it on every start (e.g. "source .venv/bin/activate").
    time: Slurm's time limit (--time), empty: the partition's.
    partition: Slurm's partition, empty: the default one.
    cpus_per_node: CPUs asked on each node (Slurm --cpus-per-task, k8s requests), 0: the
        scheduler's default.
    gpus_per_node: GPUs asked on each node, 0: none.
    signal_s: seconds of warning before the time limit (Slurm --signal) and the grace of a
        pod's termination (Kubernetes): at least preempt_budget_s + GRACE_MARGIN_S.
    image: Kubernetes: the container image holding dataparallel.
    claim: Kubernetes: the PersistentVolumeClaim (ReadWriteMany) mounted at /runs.
    max_restarts: Kubernetes: restarts of the whole JobSet after a failure that is not a
        disruption.
    """

    name: str = "dataparallel"
    nodes: int = 1
    nproc: int = 2
    layout: str = "node"
    run_dir: str = ""
    train_args: tuple[str, ...] = ()
    preempt_budget_s: float = DEFAULT_BUDGET_S
    program: str = "dataparallel"
    setup: str = ""
    time: str = ""
    partition: str = ""
    cpus_per_node: int = 0
    gpus_per_node: int = 0
    signal_s: int = 90
    image: str = "ghcr.io/OWNER/dataparallel:latest"
    claim: str = "dataparallel-runs"
    max_restarts: int = 3


def check_spec(spec: JobSpec) -> None:
    """Each bad field: one line naming its flag and the fix."""
    for name in ("nodes", "nproc", "signal_s"):
        if getattr(spec, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", "is below 1", "give 1 or more")
    if spec.signal_s < spec.preempt_budget_s + GRACE_MARGIN_S:
        need = spec.preempt_budget_s + GRACE_MARGIN_S
        raise ConfigError(
            "--signal-s",
            f"{spec.signal_s} s does not hold --preempt-budget {spec.preempt_budget_s:g} s plus {GRACE_MARGIN_S} s",
            f"give --signal-s {need:g} or more, or a smaller --preempt-budget",
        )
    if spec.layout not in ("node", "worker"):
        raise ConfigError("--layout", f"{spec.layout!r} is not a layout", "give node or worker")
    if not spec.name or not all(c.isalnum() or c == "-" for c in spec.name):
        raise ConfigError("--name", f"{spec.name!r}", "give letters, digits and dashes")
    if spec.cpus_per_node and spec.layout == "worker" and spec.cpus_per_node % spec.nproc:
        raise ConfigError(
            "--cpus-per-node",
            f"{spec.cpus_per_node} does not split over {spec.nproc} tasks",
            "give a multiple of --nproc",
        )


def _train_line(spec: JobSpec, run_dir: str) -> str:
    """The arguments of `dataparallel train`, the same at every start ([Note: requeue])."""
    args = [*spec.train_args, "--nproc", str(spec.nproc), "--out", run_dir, "--resume", "auto"]
    return shlex.join(args)


def slurm_script(spec: JobSpec, printed_by: str) -> str:
    """The sbatch script ([Note: requeue])."""
    check_spec(spec)
    run_dir = spec.run_dir or f"runs/{spec.name}"
    per_worker = spec.layout == "worker"
    tasks = spec.nproc if per_worker else 1
    train = _train_line(spec, run_dir)
    layout = (
        f"one task per worker: {spec.nproc} tasks per node, each trains in place"
        if per_worker
        else f"one task per node: it starts the node's {spec.nproc} workers"
    )
    lines = [
        "#!/bin/bash",
        f"# Printed by: {printed_by}",
        "# Assumed:",
        f"# - {spec.nodes} node(s), {layout}.",
        f"# - {run_dir} is on a file system every node shares (relative paths: under the",
        "#   directory sbatch is run from): node 0 writes the run there, and --resume auto",
        "#   resumes a requeued job from its latest checkpoint.",
        f"# - `{spec.program}` starts dataparallel on every node"
        + (f", after `{spec.setup}`." if spec.setup else "."),
        f"# - USR1 {spec.signal_s} s before the time limit (or scancel --batch --signal=USR1)",
        "#   goes to the step: it saves its step within --preempt-budget, exits with",
        f"#   {PREEMPTED} and the job is requeued (scontrol requeue); other statuses are the job's.",
        f"#SBATCH --job-name={spec.name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
    ]
    if spec.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_node // tasks}")
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    lines += [f"#SBATCH --time={spec.time}"] if spec.time else []
    lines += [f"#SBATCH --partition={spec.partition}"] if spec.partition else []
    lines += [
        f"#SBATCH --signal=B:USR1@{spec.signal_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={spec.name}-%j.out",
        *([spec.setup] if spec.setup else []),
        "set -u",
        "trap 'kill -USR1 \"$step\" 2>/dev/null' USR1  # srun passes it to the tasks",
        f"srun --ntasks-per-node={tasks} {spec.program} train {train} &",
        "step=$!",
        'wait "$step"; status=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done',
        f'if [ "$status" = {PREEMPTED} ]; then  # PREEMPTED: the step saved, the next start resumes',
        '  echo "dataparallel: preempted: requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


# A string YAML reads back as itself when written bare: a name, a path, a URL-like key.
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}


def _scalar(value) -> str:
    """A YAML scalar: bare where it reads back as the same string, else JSON's spelling (which
    is YAML's)."""
    if isinstance(value, str) and _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


def yaml_lines(mapping: dict, indent: int = 0) -> list[str]:
    """`mapping` as YAML block lines: nested dicts as blocks, lists of dicts as block sequences,
    lists of scalars as flow lists (`[a, 1]`). The subset a manifest needs; no dependency."""
    pad = "  " * indent
    lines = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            lines += [f"{pad}{_scalar(key)}:", *yaml_lines(value, indent + 1)]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{_scalar(key)}:")
            for entry in value:
                first, *rest = yaml_lines(entry, indent + 2)
                lines += [f"{pad}  - {first.lstrip()}", *rest]
        elif isinstance(value, list):
            lines.append(f"{pad}{_scalar(key)}: [{', '.join(_scalar(v) for v in value)}]")
        else:
            lines.append(f"{pad}{_scalar(key)}: {_scalar(value)}")
    return lines


def k8s_manifest(spec: JobSpec, printed_by: str) -> str:
    """A TrainingRuntime and the TrainJob that uses it (Kubeflow Trainer v2), [Note: requeue]:
    the torch runtime's PET_* variables reach our launcher in each node's pod."""
    check_spec(spec)
    if spec.layout != "node":
        raise ConfigError("--layout", "worker is Slurm's", "leave --layout out for k8s")
    run_dir = spec.run_dir or f"/runs/{spec.name}"
    api = "trainer.kubeflow.org/v1alpha1"
    runtime = {
        "apiVersion": api,
        "kind": "TrainingRuntime",
        "metadata": {
            "name": f"{spec.name}-runtime",
            "labels": {"trainer.kubeflow.org/framework": "torch"},
        },
        "spec": {
            "mlPolicy": {"numNodes": spec.nodes, "torch": {"numProcPerNode": spec.nproc}},
            "template": {"spec": _jobset(spec, run_dir)},
        },
    }
    job = {
        "apiVersion": api,
        "kind": "TrainJob",
        "metadata": {"name": spec.name},
        "spec": {
            "runtimeRef": {
                "name": f"{spec.name}-runtime",
                "apiGroup": "trainer.kubeflow.org",
                "kind": "TrainingRuntime",
            }
        },
    }
    lines = [*_k8s_assumed(spec, run_dir, printed_by), *yaml_lines(runtime), "---"]
    return "\n".join([*lines, *yaml_lines(job)]) + "\n"


def _k8s_assumed(spec: JobSpec, run_dir: str, printed_by: str) -> list[str]:
    """The manifest's first lines: who printed it and what it assumed."""
    placeholder = " (a placeholder: give --image)." if spec.image == JobSpec.image else "."
    return [
        f"# Printed by: {printed_by}",
        "# Assumed:",
        "# - Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) and JobSet are installed; its",
        "#   torch policy sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and",
        "#   PET_MASTER_PORT in each node's pod, and dataparallel train reads them.",
        f"# - {spec.nodes} node(s) of {spec.nproc} workers; image {spec.image} holds dataparallel"
        + placeholder,
        f"# - the PersistentVolumeClaim {spec.claim} (ReadWriteMany) holds the run directory",
        f"#   {run_dir}: node 0 writes the run there, and --resume auto resumes a restarted job",
        "#   from its latest checkpoint.",
        "# - a disruption (preemption, eviction: the pod's DisruptionTarget condition) or the",
        f"#   container's exit with {PREEMPTED} (it saved its step) fails the node's Job by its pod",
        "#   failure policy, and the JobSet then restarts every node without counting it; other",
        f"#   failures restart it at most {spec.max_restarts} times.",
        f"# - the pods get SIGTERM and {spec.signal_s} s, which hold --preempt-budget "
        f"{spec.preempt_budget_s:g} s.",
    ]


def _jobset(spec: JobSpec, run_dir: str) -> dict:
    """The runtime's JobSet: one Job per node, its failure policies ([Note: requeue])."""
    setup = f"{spec.setup} && " if spec.setup else ""
    container = {
        "name": "node",
        "image": spec.image,
        "command": [
            "/bin/sh",
            "-c",
            f"{setup}exec {spec.program} train {_train_line(spec, run_dir)}",
        ],
        "volumeMounts": [{"name": "runs", "mountPath": "/runs"}],
    }
    resources = {}
    if spec.cpus_per_node:
        resources["cpu"] = spec.cpus_per_node
    if spec.gpus_per_node:
        resources["nvidia.com/gpu"] = spec.gpus_per_node
    if resources:
        container["resources"] = {"requests": resources, "limits": dict(resources)}
    pod = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.signal_s,
        "containers": [container],
        "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": spec.claim}}],
    }
    exit_rule = {"containerName": "node", "operator": "In", "values": [PREEMPTED]}
    node_job = {
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {"action": "FailJob", "onExitCodes": exit_rule},
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
        "template": {"spec": pod},
    }
    ancestor = {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    return {
        "failurePolicy": {
            "maxRestarts": spec.max_restarts,
            "rules": [
                {
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        },
        "replicatedJobs": [
            {"name": "node", "template": {"metadata": {"labels": ancestor}, "spec": node_job}}
        ],
    }

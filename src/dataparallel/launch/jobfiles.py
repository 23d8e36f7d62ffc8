"""Job files that run `dataparallel train` on a scheduler: an sbatch script, a Kubeflow TrainJob.

`dataparallel cluster slurm|k8s ARGS...` (cluster_command.py) prints them. Each says in its
first lines what it assumed, and each keeps the run in one shared run directory, so that a
requeued or restarted job finds it and resumes (`--resume RUN_DIR`) instead of starting over.

[Note: requeue] Slurm requeues a job only when asked (`scontrol requeue`, from the script) and
Kubernetes restarts a TrainJob's pods only when a failure policy says so. The sbatch script asks
Slurm for USR1 `signal_s` seconds before the time limit (`--signal=B:USR1@S`, to the batch
shell), forwards it to the job step, waits for the step to end and requeues the job; the
manifest's pod failure policy turns a disruption (preemption, eviction) into a restart of the
whole JobSet that does not count against its restarts. The next start resumes from the run's
latest complete checkpoint (written every --checkpoint-every steps); a checkpoint written at the
signal itself is not there yet (issue 31 item 4): the steps since the last one are redone.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from .config import ConfigError


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
    train_args: the arguments of `dataparallel train` other than --nproc and --out.
    program: how the nodes start dataparallel ("dataparallel", "python -m dataparallel.cli").
    setup: a shell line run before it on every start (e.g. "source .venv/bin/activate").
    time: Slurm's time limit (--time), empty: the partition's.
    partition: Slurm's partition, empty: the default one.
    cpus_per_node: CPUs asked on each node (Slurm --cpus-per-task, k8s requests), 0: the
        scheduler's default.
    gpus_per_node: GPUs asked on each node, 0: none.
    signal_s: seconds of warning before the time limit (Slurm --signal) and the grace of a
        pod's termination (Kubernetes).
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


def _train_line(spec: JobSpec, run_dir: str) -> tuple[str, str]:
    """(the first start's arguments, a restart's arguments) of `dataparallel train`."""
    first = shlex.join([*spec.train_args, "--nproc", str(spec.nproc), "--out", run_dir])
    return first, shlex.join(["--resume", run_dir])


def slurm_script(spec: JobSpec, printed_by: str) -> str:
    """The sbatch script ([Note: requeue])."""
    check_spec(spec)
    run_dir = spec.run_dir or f"runs/{spec.name}"
    per_worker = spec.layout == "worker"
    tasks = spec.nproc if per_worker else 1
    first, again = _train_line(spec, run_dir)
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
        "#   directory sbatch is run from): node 0 writes the run there, a requeued job resumes",
        "#   from its latest checkpoint.",
        f"# - `{spec.program}` starts dataparallel on every node"
        + (f", after `{spec.setup}`." if spec.setup else "."),
        f"# - USR1 {spec.signal_s} s before the time limit: the step is told, ends, and the job",
        "#   is requeued (scontrol requeue); the steps since the last checkpoint are redone.",
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
        f"RUN_DIR={shlex.quote(run_dir)}",
        'if [ -f "$RUN_DIR/config.toml" ]; then  # requeued: resume the run',
        f"  set -- {again}",
        "else",
        f"  set -- {first}",
        "fi",
        "preempted=0",
        "trap 'preempted=1; kill -USR1 \"$step\" 2>/dev/null' USR1  # srun passes it to the tasks",
        f'srun --ntasks-per-node={tasks} {spec.program} train "$@" &',
        "step=$!",
        'wait "$step"; status=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done',
        'if [ "$preempted" = 1 ]; then',
        '  echo "dataparallel: USR1 before the time limit: requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _yaml(value) -> str:
    """A YAML scalar or flow list (JSON's spelling is YAML's)."""
    return json.dumps(value)


def k8s_manifest(spec: JobSpec, printed_by: str) -> str:
    """A TrainingRuntime and the TrainJob that uses it (Kubeflow Trainer v2), [Note: requeue]:
    the torch runtime's PET_* variables reach our launcher in each node's pod."""
    check_spec(spec)
    if spec.layout != "node":
        raise ConfigError("--layout", "worker is Slurm's", "leave --layout out for k8s")
    run_dir = spec.run_dir or f"/runs/{spec.name}"
    first, again = _train_line(spec, run_dir)
    program = f"{spec.setup} && " if spec.setup else ""
    shell = (
        f"{program}if [ -f {shlex.quote(run_dir)}/config.toml ]; "
        f"then exec {spec.program} train {again}; "
        f"else exec {spec.program} train {first}; fi"
    )
    resources = {}
    if spec.cpus_per_node:
        resources["cpu"] = spec.cpus_per_node
    if spec.gpus_per_node:
        resources["nvidia.com/gpu"] = spec.gpus_per_node
    limits = ["                      resources:"]
    for key in ("requests", "limits"):
        limits.append(f"                        {key}:")
        limits += [f"                          {k}: {_yaml(v)}" for k, v in resources.items()]
    lines = [
        f"# Printed by: {printed_by}",
        "# Assumed:",
        "# - Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) and JobSet are installed; its",
        "#   torch policy sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and",
        "#   PET_MASTER_PORT in each node's pod, and dataparallel train reads them.",
        f"# - {spec.nodes} node(s) of {spec.nproc} workers; image {spec.image} holds dataparallel"
        + (" (a placeholder: give --image)." if spec.image == JobSpec.image else "."),
        f"# - the PersistentVolumeClaim {spec.claim} (ReadWriteMany) holds the run directory",
        f"#   {run_dir}: node 0 writes the run there, a restarted job resumes from it.",
        "# - a disruption (preemption, eviction: the pod's DisruptionTarget condition) fails the",
        "#   node's Job by its pod failure policy, and the JobSet then restarts every node without",
        f"#   counting it; other failures restart it at most {spec.max_restarts} times. The pods",
        f"#   get SIGTERM and {spec.signal_s} s; the steps since the last checkpoint are redone.",
        "apiVersion: trainer.kubeflow.org/v1alpha1",
        "kind: TrainingRuntime",
        "metadata:",
        f"  name: {spec.name}-runtime",
        "  labels:",
        "    trainer.kubeflow.org/framework: torch",
        "spec:",
        "  mlPolicy:",
        f"    numNodes: {spec.nodes}",
        "    torch:",
        f"      numProcPerNode: {spec.nproc}",
        "  template:",
        "    spec:",
        "      failurePolicy:",
        f"        maxRestarts: {spec.max_restarts}",
        "        rules:",
        "          - action: RestartJobSetAndIgnoreMaxRestarts",
        "            onJobFailureReasons: [PodFailurePolicy]",
        "      replicatedJobs:",
        "        - name: node",
        "          template:",
        "            metadata:",
        "              labels:",
        "                trainer.kubeflow.org/trainjob-ancestor-step: trainer",
        "            spec:",
        "              backoffLimit: 0",
        "              podFailurePolicy:",
        "                rules:",
        "                  - action: FailJob",
        "                    onPodConditions:",
        "                      - type: DisruptionTarget",
        "              template:",
        "                spec:",
        "                  restartPolicy: Never",
        f"                  terminationGracePeriodSeconds: {spec.signal_s}",
        "                  containers:",
        "                    - name: node",
        f"                      image: {_yaml(spec.image)}",
        f"                      command: {_yaml(['/bin/sh', '-c', shell])}",
        "                      volumeMounts:",
        "                        - name: runs",
        "                          mountPath: /runs",
        *(limits if resources else []),
        "                  volumes:",
        "                    - name: runs",
        "                      persistentVolumeClaim:",
        f"                        claimName: {spec.claim}",
        "---",
        "apiVersion: trainer.kubeflow.org/v1alpha1",
        "kind: TrainJob",
        "metadata:",
        f"  name: {spec.name}",
        "spec:",
        "  runtimeRef:",
        f"    name: {spec.name}-runtime",
        "    apiGroup: trainer.kubeflow.org",
        "    kind: TrainingRuntime",
    ]
    return "\n".join(lines) + "\n"

"""`dataparallel cluster slurm|k8s ARGS...`: print the job file that runs `dataparallel train
ARGS` on a scheduler (jobfiles.py; cli.py registers the command).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import fields

from .command import add_command, refused
from .config import ConfigError, field_docs
from .jobfiles import JobSpec, k8s_manifest, slurm_script
from .preemption import DEFAULT_BUDGET_S

USAGE = """Print the sbatch script or the Kubeflow TrainJob that runs `dataparallel train ARGS`,
with the requeue signal and the shared run directory in place; it says what it assumed.

    dataparallel cluster slurm --nodes 2 --nproc 4 --steps 1000 > job.sbatch && sbatch job.sbatch
    dataparallel cluster slurm --nodes 2 --nproc 4 --layout worker --steps 1000
    dataparallel cluster k8s --nodes 2 --nproc 4 --image REGISTRY/dp:1 --steps 1000 | kubectl apply -f -

The options below are the job file's; every other argument is `dataparallel train`'s (--nproc
and --out among them: the workers per node and the shared run directory). docs/clusters.md.
"""

# JobSpec's fields that are options of `cluster` (nproc, run_dir and train_args come from ARGS).
_OPTIONS = {
    "nodes": "--nodes",
    "layout": "--layout",
    "name": "--name",
    "time": "--time",
    "partition": "--partition",
    "cpus_per_node": "--cpus-per-node",
    "gpus_per_node": "--gpus-per-node",
    "signal_s": "--signal-s",
    "program": "--program",
    "setup": "--setup",
    "image": "--image",
    "claim": "--claim",
    "max_restarts": "--job-restarts",
}


class _JobOptions(argparse.ArgumentParser):
    """A bad option value is a ConfigError (one line), not argparse's usage and exit."""

    def error(self, message: str):
        head, _, problem = message.partition(": ")
        raise ConfigError(
            head.removeprefix("argument "), problem, "see dataparallel cluster --help"
        )


def job_parser() -> argparse.ArgumentParser:
    """The job file's options, read from ARGS (the rest is the train command's)."""
    parser = _JobOptions(prog="dataparallel cluster", add_help=False, allow_abbrev=False)
    docs = field_docs(JobSpec)
    types = {f.name: f.type for f in fields(JobSpec)}
    for name, flag in _OPTIONS.items():
        kind = int if types[name] == "int" else str
        help = docs[name].replace("%", "%%")
        parser.add_argument(flag, dest=name, type=kind, metavar=flag[2:].upper(), help=help)
    parser.add_argument("--nproc", type=int, help="workers per node (a train flag)")
    parser.add_argument("--out", help="the shared run directory (a train flag)")
    return parser


def add_cluster_parser(commands) -> None:
    parser = add_command(
        commands,
        "cluster",
        cmd_cluster,
        description=USAGE,
        epilog=job_parser().format_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("scheduler", choices=("slurm", "k8s"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="job options and train's flags")


def job_spec(args: list[str]) -> JobSpec:
    """The JobSpec that `cluster ARGS` asks for (ConfigError on bad input)."""
    options, train_args = job_parser().parse_known_args(args)
    given = {k: v for k, v in vars(options).items() if v is not None}
    given["run_dir"] = given.pop("out", "")
    if "--" in train_args:
        train_args.remove("--")
    for arg in train_args:
        flag = arg.split("=", 1)[0]
        if flag in ("--resume", "--nnodes", "--node-rank", "--rdzv-endpoint"):
            raise ConfigError(
                flag,
                "is the job file's to decide",
                "leave it out (the nodes come from the scheduler, every start runs --resume auto)",
            )
    budget = _preempt_budget(train_args)
    return JobSpec(**given, train_args=tuple(train_args), preempt_budget_s=budget)


def _preempt_budget(train_args: list[str]) -> float:
    """The train command's --preempt-budget (it stays in ARGS), else its default."""
    value = str(DEFAULT_BUDGET_S)
    for i, arg in enumerate(train_args):
        if arg == "--preempt-budget" and i + 1 < len(train_args):
            value = train_args[i + 1]
        elif arg.startswith("--preempt-budget="):
            value = arg.split("=", 1)[1]
    try:
        return float(value)
    except ValueError:
        raise ConfigError(
            "--preempt-budget", f"{value!r} is not a number", "give seconds"
        ) from None


def cmd_cluster(args: argparse.Namespace) -> int:
    """print an sbatch script or a Kubeflow TrainJob that runs dataparallel train"""
    printed_by = shlex.join(["dataparallel", "cluster", args.scheduler, *args.args])
    try:
        spec = job_spec(args.args)
        make = slurm_script if args.scheduler == "slurm" else k8s_manifest
        text = make(spec, printed_by)
    except ConfigError as error:
        return refused("cluster", error)
    sys.stdout.write(text)
    return 0

"""Slurm's two layouts: one task per node (our launcher starts the node's workers) and one task
per worker (each task is a worker), read from SLURM_* ([Note: environment precedence] in
environments.py)."""

from __future__ import annotations

from .config import ConfigError
from .hostlist import expand_hostlist, expand_tasks_per_node
from .topology import Environment, check_asked

# The port rank 0 listens on under Slurm, unless MASTER_PORT says: this base plus the job id
# modulo the span, so that two jobs sharing a node rarely meet, and the same (requeued) job
# always gets the same port. It stays below Linux's ephemeral ports (32768 and up).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000


class Slurm(Environment):
    """What both Slurm layouts read: the step's nodes, tasks and host list (the job's, when
    the step's are absent), the job id and the port derived from it."""

    node_rank_variable = "SLURM_NODEID"
    fix = "run it under srun inside a Slurm job, which sets it"

    def first(self, *names: str) -> str:
        """The first of `names` that is set (the step's variable, then the job's)."""
        return next((name for name in names if self.env.get(name)), names[-1])

    def nnodes(self) -> int:
        return self.number(self.first("SLURM_STEP_NUM_NODES", "SLURM_NNODES"), self.fix)

    def ntasks(self) -> int:
        name = self.first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        return self.number(name, self.fix, default=self.nnodes())

    def node_rank(self) -> int:
        return self.number("SLURM_NODEID", self.fix, default=0)

    def main_address(self) -> str:
        name = self.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        return expand_hostlist(self.text(name, self.fix), name)[0]

    def main_port(self) -> int:
        if self.env.get("MASTER_PORT"):
            return self.number("MASTER_PORT", "give a port number")
        job = self.number(self.first("SLURM_JOB_ID", "SLURM_JOBID"), self.fix)
        return SLURM_PORT_BASE + job % SLURM_PORT_SPAN

    def in_step(self) -> bool:
        """Whether this process is a task of srun (a job step), not the batch script."""
        return bool(self.env.get("SLURM_STEP_ID") or self.env.get("SLURM_STEPID"))


class SlurmTaskPerWorker(Slurm):
    """`srun --ntasks-per-node=N dataparallel train`: each task is a worker (SLURM_PROCID,
    SLURM_LOCALID, SLURM_NTASKS); the tasks per node must be even."""

    source = "slurm, one task per worker"

    def detect(self) -> bool:
        return "SLURM_JOB_ID" in self.env and self.in_step() and self.ntasks() > self.nnodes()

    def is_worker(self) -> bool:
        return True

    def workers_per_node(self, asked: int | None, default: int) -> int:
        name = self.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        counts = expand_tasks_per_node(self.text(name, self.fix), name)
        if len(set(counts)) != 1:
            raise ConfigError(
                name,
                f"{self.env[name]!r}: nodes run different numbers of tasks",
                "give srun --ntasks-per-node=N (or one task per node: --ntasks-per-node=1)",
            )
        fix = "give srun --ntasks-per-node equal to --nproc, or leave --nproc out"
        return check_asked(name, counts[0], asked, fix)

    def global_rank(self) -> int:
        return self.number("SLURM_PROCID", self.fix)

    def local_rank(self) -> int:
        return self.number("SLURM_LOCALID", self.fix)


class SlurmTaskPerNode(Slurm):
    """`srun --ntasks-per-node=1 dataparallel train`: one task per node, our launcher starts
    that node's workers; nodes, node rank and node 0's address come from SLURM_*."""

    source = "slurm, one task per node"

    def detect(self) -> bool:
        return "SLURM_JOB_ID" in self.env

    def is_worker(self) -> bool:
        return False

    def nnodes(self) -> int:
        nodes = super().nnodes()
        if nodes > 1 and not self.in_step():
            raise ConfigError(
                "SLURM_STEP_ID",
                f"not set: this is the job's batch script, not a task of srun, on {nodes} nodes",
                "start it as srun --ntasks-per-node=1 dataparallel train ...",
            )
        return nodes

    def workers_per_node(self, asked: int | None, default: int) -> int:
        return asked or default  # the node's workers are ours to start

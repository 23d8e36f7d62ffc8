"""The scheduler or launcher that started this process, read from its environment variables.

One small class per environment, one interface (Lightning's ClusterEnvironment): `detect()`,
`is_worker()`, `nnodes()`, `node_rank()`, `workers_per_node()`, `global_rank()`,
`local_rank()`, `main_address()`, `main_port()`; `topology(asked)` combines them into a
`Topology`, the one thing the launcher and the CLI ask. Every class reads only the mapping it
is given (never os.environ), so its rules are tested with plain dicts.

[Note: environment precedence] `detect(env)` asks the classes in this order and takes the first
that recognises the environment:
    1. torchrun, Ray Train (RANK and WORLD_SIZE set): the process is a worker. They win over
       SLURM_* (`srun torchrun ...`) and PET_* (a pod that starts torchrun itself).
    2. MPI (OMPI_COMM_WORLD_SIZE): `mpirun` started each worker.
    3. Kubeflow Trainer (PET_NNODES): our launcher starts this node's workers.
    4. Slurm, one task per worker (a job step with more tasks than nodes): each task a worker.
    5. Slurm, one task per node (SLURM_JOB_ID): our launcher starts this node's workers.
None of them: the flags decide (--nnodes, --node-rank, --rdzv-endpoint).

A bad or inconsistent allocation raises ConfigError naming the variable and the fix, one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .config import ConfigError
from .hostlist import expand_hostlist, expand_tasks_per_node

# The port rank 0 listens on under Slurm, unless MASTER_PORT says: this base plus the job id
# modulo the span, so that two jobs sharing a node rarely meet, and the same (requeued) job
# always gets the same port. It stays below Linux's ephemeral ports (32768 and up).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where this process stands in the run, as the environment that started it says.

    source: the environment, in words ("slurm, one task per node").
    worker: this process is one worker and trains in place (started by srun per worker,
        torchrun, Ray or mpirun); False: our launcher starts `nproc` workers on this node.
    nnodes: nodes (machines) in the run.
    node_rank: this node's index, 0..nnodes-1.
    nproc: workers on each node.
    main_address: the host of rank 0 (node 0), where the workers meet.
    main_port: the port there.
    rank: this worker's global rank (a worker only; else 0).
    local_rank: this worker's index on its node (a worker only; else 0).
    """

    source: str
    worker: bool
    nnodes: int
    node_rank: int
    nproc: int
    main_address: str
    main_port: int
    rank: int = 0
    local_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def describe(self) -> str:
        """The one line printed at start."""
        where = f"rank 0 at {self.main_address}:{self.main_port}"
        if self.worker:
            return (
                f"{self.source}: rank {self.rank} of world {self.world_size} (worker "
                f"{self.local_rank} of {self.nproc} on node {self.node_rank} of "
                f"{self.nnodes}), {where}"
            )
        return (
            f"{self.source}: node {self.node_rank} of {self.nnodes}, {self.nproc} "
            f"worker{'s' if self.nproc > 1 else ''} each "
            f"(world {self.world_size}), {where}"
        )

    def launch_fields(self) -> dict:
        """The [launch] fields this topology decides."""
        fields = {"nproc": self.nproc, "nnodes": self.nnodes, "node_rank": self.node_rank}
        if self.nnodes > 1:
            fields["rdzv_endpoint"] = f"{self.main_address}:{self.main_port}"
        return fields

    def worker_variables(self) -> dict[str, str]:
        """torchrun's variables for a process that is a worker (what dp.init() reads)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.main_address,
            "MASTER_PORT": str(self.main_port),
        }


class Environment:
    """One scheduler's or launcher's variables; subclasses read them, `topology` combines."""

    source = ""  # the environment, in words
    node_rank_variable = ""  # the variable a bad node rank is blamed on

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def detect(self) -> bool:
        raise NotImplementedError

    def is_worker(self) -> bool:
        raise NotImplementedError

    def nnodes(self) -> int:
        raise NotImplementedError

    def node_rank(self) -> int:
        raise NotImplementedError

    def workers_per_node(self, asked: int | None, default: int) -> int:
        """Workers on each node; `asked` is --nproc when the user gave it, else None; `default`
        the config's nproc, for an environment that leaves the number to us."""
        raise NotImplementedError

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def main_address(self) -> str:
        raise NotImplementedError

    def main_port(self) -> int:
        raise NotImplementedError

    def topology(self, asked: int | None = None, default: int = 2) -> Topology:
        """The answers as one Topology; ConfigError naming the variable that does not fit."""
        topology = Topology(
            source=self.source,
            worker=self.is_worker(),
            nnodes=self.nnodes(),
            node_rank=self.node_rank(),
            nproc=self.workers_per_node(asked, default),
            main_address=self.main_address(),
            main_port=self.main_port(),
            rank=self.global_rank(),
            local_rank=self.local_rank(),
        )
        if not 0 <= topology.node_rank < topology.nnodes:
            raise ConfigError(
                self.node_rank_variable,
                f"{topology.node_rank} is not below the {topology.nnodes} nodes",
                "start one process per node with ranks 0..nodes-1",
            )
        return topology

    # Reading variables, each failure one line naming the variable.
    def text(self, name: str, fix: str) -> str:
        value = self.env.get(name, "")
        if not value:
            raise ConfigError(name, "is not set", fix)
        return value

    def number(self, name: str, fix: str, default: int | None = None) -> int:
        if default is not None and not self.env.get(name):
            return default
        value = self.text(name, fix)
        if not value.isdigit():
            raise ConfigError(name, f"{value!r} is not a whole number", fix)
        return int(value)


def _check_asked(variable: str, have: int, asked: int | None, fix: str) -> int:
    """`have` workers per node from `variable`, unless --nproc asked for another number."""
    if asked is not None and asked != have:
        raise ConfigError(variable, f"{have} workers per node, but --nproc {asked}", fix)
    return have


class Torchrun(Environment):
    """torchrun or Ray Train started this process as a worker: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (GROUP_RANK from torchrun, NODE_RANK from Ray)."""

    source = "torchrun/Ray worker"
    node_rank_variable = "GROUP_RANK"
    fix = "start it with torchrun or Ray Train, which set it"

    def detect(self) -> bool:
        return "RANK" in self.env and "WORLD_SIZE" in self.env

    def is_worker(self) -> bool:
        return True

    def _local_world(self) -> int:
        local = self.number("LOCAL_WORLD_SIZE", self.fix, default=self.world())
        if local < 1 or self.world() % local:
            raise ConfigError(
                "LOCAL_WORLD_SIZE",
                f"{local} does not divide WORLD_SIZE={self.world()}",
                "give every node the same number of workers",
            )
        return local

    def world(self) -> int:
        return self.number("WORLD_SIZE", self.fix)

    def nnodes(self) -> int:
        return self.world() // self._local_world()

    def node_rank(self) -> int:
        name = "GROUP_RANK" if "GROUP_RANK" in self.env else "NODE_RANK"
        return self.number(name, self.fix, default=self.global_rank() // self._local_world())

    def workers_per_node(self, asked: int | None, default: int) -> int:
        # torchrun's --nproc-per-node decided; our --nproc is torchrun's business then.
        return self._local_world()

    def global_rank(self) -> int:
        rank = self.number("RANK", self.fix)
        if rank >= self.world():
            raise ConfigError("RANK", f"{rank} is not below WORLD_SIZE={self.world()}", self.fix)
        return rank

    def local_rank(self) -> int:
        return self.number("LOCAL_RANK", self.fix, default=0)

    def main_address(self) -> str:
        return self.text("MASTER_ADDR", "set it to rank 0's host (torchrun and Ray set it)")

    def main_port(self) -> int:
        return self.number("MASTER_PORT", "set it to a free port on rank 0's host")


class OpenMPI(Environment):
    """`mpirun` started this process as a worker: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,
    LOCAL_SIZE}; rank 0's address comes from MASTER_ADDR (mpirun -x MASTER_ADDR=HOST)."""

    source = "MPI worker"
    node_rank_variable = "OMPI_COMM_WORLD_RANK"
    fix = "start it with mpirun, which sets it"

    def detect(self) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in self.env

    def is_worker(self) -> bool:
        return True

    def _local_world(self) -> int:
        world = self.number("OMPI_COMM_WORLD_SIZE", self.fix)
        local = self.number("OMPI_COMM_WORLD_LOCAL_SIZE", self.fix)
        if local < 1 or world % local:
            raise ConfigError(
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                f"{local} does not divide OMPI_COMM_WORLD_SIZE={world}",
                "give every node the same number of ranks (mpirun --map-by ppr:N:node)",
            )
        return local

    def nnodes(self) -> int:
        return self.number("OMPI_COMM_WORLD_SIZE", self.fix) // self._local_world()

    def node_rank(self) -> int:
        return self.global_rank() // self._local_world()

    def workers_per_node(self, asked: int | None, default: int) -> int:
        fix = "give mpirun as many ranks per node as --nproc, or leave --nproc out"
        return _check_asked("OMPI_COMM_WORLD_LOCAL_SIZE", self._local_world(), asked, fix)

    def global_rank(self) -> int:
        return self.number("OMPI_COMM_WORLD_RANK", self.fix)

    def local_rank(self) -> int:
        return self.number("OMPI_COMM_WORLD_LOCAL_RANK", self.fix)

    def main_address(self) -> str:
        return self.text("MASTER_ADDR", "pass rank 0's host: mpirun -x MASTER_ADDR=HOST")

    def main_port(self) -> int:
        return self.number("MASTER_PORT", "pass a free port: mpirun -x MASTER_PORT=PORT", 29500)


class Kubeflow(Environment):
    """Kubeflow Trainer's torch contract: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
    PET_MASTER_ADDR, PET_MASTER_PORT; our launcher starts this pod's workers."""

    source = "kubeflow"
    node_rank_variable = "PET_NODE_RANK"
    fix = "run it from a TrainJob of the torch runtime, which sets it"

    def detect(self) -> bool:
        return "PET_NNODES" in self.env

    def is_worker(self) -> bool:
        return False

    def nnodes(self) -> int:
        value = self.text("PET_NNODES", self.fix)
        if ":" in value:
            raise ConfigError(
                "PET_NNODES", f"{value!r} is an elastic range", "give a fixed number of nodes"
            )
        return self.number("PET_NNODES", self.fix)

    def node_rank(self) -> int:
        return self.number("PET_NODE_RANK", self.fix)

    def workers_per_node(self, asked: int | None, default: int) -> int:
        value = self.env.get("PET_NPROC_PER_NODE", "auto")
        if not value.isdigit():  # "auto", "cpu", "gpu": ours to decide
            return asked or default
        fix = "make numProcPerNode equal --nproc, or leave --nproc out"
        return _check_asked("PET_NPROC_PER_NODE", int(value), asked, fix)

    def main_address(self) -> str:
        return self.text("PET_MASTER_ADDR", self.fix)

    def main_port(self) -> int:
        return self.number("PET_MASTER_PORT", self.fix)


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
        return _check_asked(name, counts[0], asked, fix)

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


ENVIRONMENTS = (Torchrun, OpenMPI, Kubeflow, SlurmTaskPerWorker, SlurmTaskPerNode)


def detect(env: Mapping[str, str]) -> Environment | None:
    """The environment that started this process ([Note: environment precedence]), or None."""
    for cls in ENVIRONMENTS:
        environment = cls(env)
        if environment.detect():
            return environment
    return None

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

from .config import ConfigError
from .slurm import SlurmTaskPerNode, SlurmTaskPerWorker
from .topology import Environment, check_asked


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
        return check_asked("OMPI_COMM_WORLD_LOCAL_SIZE", self._local_world(), asked, fix)

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
        return check_asked("PET_NPROC_PER_NODE", int(value), asked, fix)

    def main_address(self) -> str:
        return self.text("PET_MASTER_ADDR", self.fix)

    def main_port(self) -> int:
        return self.number("PET_MASTER_PORT", self.fix)


ENVIRONMENTS = (Torchrun, OpenMPI, Kubeflow, SlurmTaskPerWorker, SlurmTaskPerNode)


def detect(env: Mapping[str, str]) -> Environment | None:
    """The environment that started this process ([Note: environment precedence]), or None."""
    for cls in ENVIRONMENTS:
        environment = cls(env)
        if environment.detect():
            return environment
    return None

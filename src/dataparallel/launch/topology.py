"""What a launcher needs to know of the machines it runs on (`Topology`), and the interface
every environment answers it through (`Environment`); the environments themselves are in
environments.py and slurm.py ([Note: environment precedence] in environments.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .config import ConfigError


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


def check_asked(variable: str, have: int, asked: int | None, fix: str) -> int:
    """`have` workers per node from `variable`, unless --nproc asked for another number."""
    if asked is not None and asked != have:
        raise ConfigError(variable, f"{have} workers per node, but --nproc {asked}", fix)
    return have

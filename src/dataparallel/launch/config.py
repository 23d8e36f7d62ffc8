"""The launcher's configuration, shared by every command that starts workers.

`LaunchConfig` is the [launch] section of `dataparallel train`'s config (train/config.py) and
the flags of `dataparallel launch`, `generate` and `eval` (flags.py). `ConfigError` and the
field and flag labels are how every command names bad input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


class ConfigError(ValueError):
    """Bad input, reported on one line as `<field>: <problem>; <fix>` (the CLI exits 2)."""

    def __init__(self, field: str, problem: str, fix: str):
        super().__init__(f"{field}: {problem}; {fix}")
        self.field, self.problem, self.fix = field, problem, fix


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Where and how the workers run.

    nproc: worker processes on this machine (started through torch.distributed.run).
    strategy: data-parallel strategy, a name from dataparallel.strategies.POLICIES ("ddp"...).
    shard_group: ranks per shard group for zero1/2/3 on a 2-D mesh (HSDP: shard within groups
        of this many consecutive ranks, replicate across the groups); must divide the world
        size. 0: shard over every rank.
    tp: tensor-parallel ranks: the reference GPT's attention heads and MLP are split over tp
        consecutive ranks, the data parallelism runs over world / tp ("world 4 = dp 2 x tp 2");
        must divide the ranks, the heads and the width (docs/core.md). 1: none.
    out: run directory for metrics, checkpoints and the report; empty: runs/<time>-<model>.
    threads: torch threads per worker; 0: a fair share, max(1, cores // nproc).
    max_restarts: times the launcher restarts the workers after one dies; they resume from
        the latest complete checkpoint by themselves. 0: a dead worker ends the run.
    nnodes: machines in the job; more than 1 needs node_rank and rdzv_endpoint.
    node_rank: this machine's index, 0..nnodes-1 (node 0 hosts rank 0 and writes the run).
    rdzv_endpoint: host:port of node 0 where the machines meet (multi-node only).
    collective_timeout: seconds a collective may wait for the other ranks before the run stops
        with one line naming the ranks that never arrived and the collective (docs/watchdog.md);
        must exceed the longest time one rank works alone while others wait (a checkpoint
        write). 0: no watchdog (a hang then ends at gloo's 10-minute timeout, naming nobody).
    check_collectives: before every collective, check that all ranks call the same kind,
        shape and dtype, and stop at the first that differs, naming the rank (a slow debug mode;
        docs/watchdog.md).
    recovery: what a lost worker costs the others. "restart": every worker restarts and
        resumes from the latest checkpoint (torchrun's agent, up to max_restarts times).
        "live": the others go on without stopping; they regroup at the step, redo it with the
        whole global batch, and a replacement (up to max_restarts in all) receives the state
        from them over the network and joins (one machine, ddp, fp32 or bf16;
        docs/faults.md, "Live recovery").
    min_replicas: live recovery: the fewest replicas the run trains with (1 or more, at most
        nproc). A `dataparallel leave` that would go below it is refused; a loss that does
        waits for a replacement or a joiner on its way (up to collective_timeout + 10 s), else
        stops the run with the line to --resume it (docs/faults.md, "Membership changes").
    max_replicas: live recovery: the most replicas; `dataparallel join RUN_DIR` adds one while
        the run counts fewer (at least nproc). 0: nproc, the run does not grow.
    store_host: live recovery: the address of this machine at which `dataparallel join` from
        another machine reaches the launcher's store (it is written to RUN_DIR/live.json; the
        store listens on this address only). Empty: 127.0.0.1, joiners on this machine only.
    preempt_budget: seconds the workers have, from a SIGTERM or SIGUSR1 to the launcher, to
        finish their step and write a checkpoint before they are killed (the previous
        checkpoint then stays the latest); also the agent's grace on Ctrl-C and failures. Keep
        it under the scheduler's grace (30 s on Slurm and Kubernetes; [Note: preemption] in
        launch/preemption.py).
    """

    nproc: int = 2
    strategy: str = "ddp"
    shard_group: int = 0
    tp: int = 1
    out: str = ""
    threads: int = 0
    max_restarts: int = 3
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    collective_timeout: float = 300.0
    check_collectives: bool = False
    recovery: str = "restart"
    min_replicas: int = 1
    max_replicas: int = 0
    store_host: str = ""
    preempt_budget: float = 25.0


# Flags whose name is not the field's name with dashes.
FLAG_NAMES = {"model.name": "--model", "data.paths": "--data"}


def field_docs(cls: type) -> dict[str, str]:
    """The "name: text" entries of a dataclass docstring, continuation lines joined."""
    docs: dict[str, str] = {}
    names = {f.name for f in fields(cls)}
    current = None
    for line in (cls.__doc__ or "").splitlines():
        head, sep, rest = line.strip().partition(": ")
        if sep and head in names and line.startswith(" " * 4) and not line.startswith(" " * 8):
            current = head
            docs[head] = rest.strip()
        elif current and line.startswith(" " * 8):
            docs[current] += " " + line.strip()
        else:
            current = None
    return docs


def flag_name(section: str, name: str) -> str:
    return FLAG_NAMES.get(f"{section}.{name}", "--" + name.replace("_", "-"))


def field_label(section: str, name: str) -> str:
    """How errors name a field: the flag and the TOML key."""
    return f"{flag_name(section, name)} ({section}.{name})"


def at_least(section: str, name: str, value: float, minimum: float) -> None:
    """`value` of the field `section.name` is a finite number of at least `minimum`."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            field_label(section, name), f"{value} is not a finite number", "give a number"
        )
    if value < minimum:
        raise ConfigError(
            field_label(section, name), f"{value} is below {minimum}", f"use {minimum} or more"
        )


def check_launch(launch: LaunchConfig) -> None:
    """Check the launcher's fields (the [launch] section that `dataparallel launch` shares)."""
    for name, minimum in [("nproc", 1), ("nnodes", 1), ("preempt_budget", 1)] + [
        (n, 0) for n in ("max_restarts", "threads", "node_rank", "collective_timeout")
    ]:
        at_least("launch", name, getattr(launch, name), minimum)
    if launch.nnodes > 1:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                field_label("launch", "rdzv_endpoint"),
                f"{launch.rdzv_endpoint!r} is not host:port",
                "give node 0's address and a free port, e.g. --rdzv-endpoint 10.0.0.1:29500",
            )
    if launch.node_rank >= launch.nnodes:
        raise ConfigError(
            field_label("launch", "node_rank"),
            f"{launch.node_rank} is not below nnodes={launch.nnodes}",
            f"use 0..{launch.nnodes - 1}",
        )

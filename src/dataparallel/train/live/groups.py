"""The process groups a live replica talks through, and the ones it left.

    move_to_world(state, seat)       # the model (and an averager) onto `state.world`'s group
    abandoned = Abandoned(timeout_s)
    abandoned.keep(state)             # before leaving a broken group: keep it, don't free it

[Note: abandoned groups] A DDP step has several bucket all-reduces in flight; when one
fails, the others are still pending on the gloo group's threads, and its destructor
waits for them to time out (up to --collective-timeout). Freed when the replica left it,
that wait held the replica's report back until the launcher left it out as stalled (1 trial
in 4). So the old group is kept (`Abandoned`), unregistered and shut down but not freed;
its pending work times out on its own threads while the run goes on (and so are the
mesh's groups of an HSDP replica or an averager: `groups_in_use`). A group abandoned
longer than twice the collective timeout has nothing pending any more, and is let go
at the next regroup: a long run with many regroups does not keep every generation's
threads and sockets.
"""

from __future__ import annotations

import time

import torch.distributed as dist

import dataparallel as dp

from ..state import TrainState
from .replica import Seat

GRACE_S = 10.0  # beyond 2 x the collective timeout: an abandoned group has nothing pending


def move_to_world(state: TrainState, seat: Seat) -> None:
    """Move the model (and an averager) to the group of `state.world`, a live run's new
    generation (or a world of one). Under an averager the model trains inside its replica (a
    group of its own) and the averager spans the replicas; an HSDP replica's model moves to
    the generation's mesh ([Note: HSDP replicas] in replica.py)."""
    if state.averager is not None:
        mesh = dp.init_mesh(1, state.world.group)
        dp.rebind(state.model, mesh.shard_group)
        state.averager.rebind(mesh.replicate_group)
    elif seat.shard > 1:
        seat.rebind(state)
    else:
        dp.rebind(state.model, state.world.group)


def groups_in_use(state: TrainState) -> list[dist.ProcessGroup]:
    """The process groups the replica talks through: the world, the strategy's and an
    averager's (each once)."""
    comms = dp.handle_of(state.model).comms()
    if state.averager is not None:
        comms.append(state.averager.comm)
    groups = [state.world.group] + [c.group for c in comms]
    return [g for i, g in enumerate(groups) if all(g is not h for h in groups[:i])]


class Abandoned:
    """The groups a replica left, kept until their pending work has timed out.

    timeout_s: --collective-timeout (a group is let go after twice that and GRACE_S).
    """

    def __init__(self, timeout_s: float):
        self.keep_s = 2 * timeout_s + GRACE_S
        self.groups: list[tuple[float, dist.ProcessGroup]] = []

    def keep(self, state: TrainState) -> None:
        """Keep the groups in use now; let go of those abandoned long enough ago."""
        now = time.monotonic()
        self.groups = [(t, group) for t, group in self.groups if now - t < self.keep_s]
        self.groups += [(now, group) for group in groups_in_use(state)]

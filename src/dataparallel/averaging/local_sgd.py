"""Averagers for slow links: local SGD and DiLoCo, called after each optimizer step.

[Note: averaging] Across hosts joined by an ordinary network, exact data parallelism waits on
the link every step. An averager lets each replica train on its own for `every` steps and
then synchronises the replicas' *parameters* once, so the link is used every `every` steps:
- local SGD (Stich 2019, Lin et al. 2020): the parameters are averaged;
- DiLoCo (Douillard et al. 2023): the replicas' mean movement since the last synchronisation,
  the outer gradient `anchor - params` (anchor: the parameters at the last synchronisation),
  is all-reduced (optionally as bf16 or with int8/fp8 error-feedback quantisation) and applied
  to the anchor by an outer optimizer, Nesterov SGD with lr 0.7 and momentum 0.9 by default
  (the paper's setting); every replica then continues from the new anchor.
A replica is a group of ranks that trains together: the model is parallelized over the replica
(`mesh.shard_group`, any strategy: DDP, ZeRO-1/2/3), and the averager works over the ranks that
hold the same part of the state (`mesh.replicate_group`). It reads and writes the tensors the
inner optimizer updates, which are exactly what a rank holds: the parameters under DDP, the
fp32 masters or shards under ZeRO, so the anchor and the outer optimizer's state are sharded
wherever the inner strategy shards. Exactness anchors (tests/dist/test_averaging.py): local SGD
with every=1 and plain SGD equals DDP; DiLoCo with every=1 and an outer SGD of lr 1 without
momentum equals local SGD with every=1.

    mesh = dp.init_mesh(ranks_per_host)                     # replicas = hosts
    dp.parallelize(model, "zero2", group=mesh.shard_group)  # exact inside a host
    optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    averager = dp.DiLoCo(model, optimizer, every=50, group=mesh.replicate_group)
    for batch in batches:
        loss(batch).backward(); optimizer.step(); optimizer.zero_grad()
        averager.step()

[Note: averager state] An averager's state is one dict, `state_dict()`: "steps" (its step
count), "tensors" (per held tensor, what it keeps beside it: DiLoCo's anchor, its outer
optimizer's state and a reduction in flight's result, "pending"; sharded as the held tensors
are), "local" (this rank's own state by name: DiLoCo's outer residuals) and, under DiLoCo,
"schedule" (the step each fragment was last synchronised at, and the last reduction's). A
checkpoint stores its steps, tensors and local (checkpoint/state.py); a live replica's rewind
keeps a copy of all of it (train/live/rewind.py's WindowMark); a heal sends `shared()`, the same
less "local" (each replica's own error), which the healed replica `adopt`s: its held tensors
then start from the anchors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..api import finish_param_gather, held_tensors, refresh_params
from ..comm import Comm
from .flat import flatten, unflatten

__all__ = ["LocalSGD", "held_tensors"]


class LocalSGD:
    """Average the held parameters over `group` every `every` steps ([Note: averaging]).

    model, optimizer: the parallelized model and the optimizer built for it.
    every: optimizer steps between averages, at least 1 (1 averages after every step).
    group: the ranks to average over (default: every rank, each its own replica).
    tracer: records its collectives (`comm.Tracer`, e.g. the one given to `parallelize`).
    """

    name = "local-sgd"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int,
        group: dist.ProcessGroup | None = None,
        tracer=None,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{self.name}: every={every!r} must be an integer >= 1 (steps)")
        self.model, self.optimizer, self.every = model, optimizer, every
        self.comm = Comm(group, tracer)
        self.tensors = held_tensors(optimizer)
        self.steps = 0
        with torch.no_grad():  # every replica starts from the same point
            if self.comm.world_size > 1:
                self.comm.broadcast_tensors(self.tensors, src=0)
        refresh_params(model)

    def step(self) -> bool:
        """Call after each optimizer step; True when this one synchronised."""
        self.steps += 1
        if self.steps % self.every:
            return False
        finish_param_gather(self.model)
        with torch.no_grad():
            self._synchronise()
        refresh_params(self.model)
        return True

    def finish(self) -> bool:
        """Call once after the last step. Local SGD ends as it stands (its "never" setting is
        the benchmarks' compute-only bound); DiLoCo ends on the replicas' average."""
        return False

    def _synchronise(self) -> None:
        flat = flatten(self.tensors).div_(self.comm.world_size)
        if self.comm.world_size > 1:
            self.comm.all_reduce(flat)
        unflatten(flat, self.tensors)

    def bytes_sent(self) -> int:
        return self.comm.total_bytes()

    def wire_bytes(self) -> int:
        return self.comm.total_wire_bytes()

    def state_dict(self) -> dict:
        """What a checkpoint and a rewind need ([Note: averager state]): local SGD holds
        nothing but its step count."""
        return {"steps": self.steps, "tensors": [{} for _ in self.tensors], "local": {}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (a checkpoint's, a rewind's mark): its "tensors" aligned with
        the held tensors (any entry may be a flat copy), its "local" this rank's own state
        (empty after a change of layout; absent: this rank's is kept)."""
        self.steps = int(state["steps"])

    def shared(self) -> dict:
        """What a replica healed at a boundary receives from a live one: the state every
        replica has in common, `state_dict()` less this rank's own "local" (local SGD: the
        step count; the parameters, equal at a boundary, travel with the model)."""
        state = self.state_dict()
        del state["local"]
        return state

    def adopt(self, shared: dict) -> None:
        """Take `shared` from a live replica, after the model and optimizer were loaded."""
        self.load_state_dict(shared)

    # -- live recovery ([Note: live averaging] in train/live/rewind.py) -----------------------------
    def rebind(self, group: dist.ProcessGroup) -> None:
        """Average over `group` from now on (a live run's next generation); state kept."""
        self.comm.rebind(group)

    def at_boundary(self) -> bool:
        """Whether every replica's movement so far has been synchronised and nothing is in
        flight: the point a live replica goes back to when a peer is lost."""
        return self.steps % self.every == 0

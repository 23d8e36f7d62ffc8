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
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .api import finish_param_gather, refresh_params
from .comm import Comm
from .compression.feedback import keyed_tensors, load_keyed_tensors
from .compression.quantize import Quantize


def held_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors `optimizer` updates: what this rank holds of the model ([Note: averaging])."""
    return [p for group in optimizer.param_groups for p in group["params"]]


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

    def _synchronise(self) -> None:
        flat = _flatten(self.tensors).div_(self.comm.world_size)
        if self.comm.world_size > 1:
            self.comm.all_reduce(flat)
        _unflatten(flat, self.tensors)

    def bytes_sent(self) -> int:
        return self.comm.total_bytes()

    def wire_bytes(self) -> int:
        return self.comm.total_wire_bytes()

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    def state_dict(self) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """(per held tensor, its state; this rank's own state), for a checkpoint. The step
        count is `steps`."""
        return [{} for _ in self.tensors], {}

    def load_state_dict(self, steps: int, shared: list[dict], local: dict) -> None:
        """Continue from a checkpoint: `shared` aligned with the held tensors (any entry may
        be a flat copy), `local` this rank's own state (empty after a change of layout)."""
        self.steps = steps


class DiLoCo(LocalSGD):
    """DiLoCo's outer step every `every` steps ([Note: averaging]).

    model, optimizer, every, group, tracer: as for LocalSGD.
    outer_optimizer: builds the outer optimizer from a list of tensors (any torch.optim class,
        e.g. `partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`, the default).
    compress: how outer gradients travel: None (fp32), "bf16", "int8" or "fp8" (the last two
        with per-block scales and error feedback, compression/quantize.py).
    """

    name = "diloco"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int,
        group: dist.ProcessGroup | None = None,
        outer_optimizer: Callable | None = None,
        compress: str | None = None,
        tracer=None,
    ):
        if compress not in (None, "bf16", "int8", "fp8"):
            raise ValueError(f"diloco: compress={compress!r} must be None, 'bf16', 'int8' or 'fp8'")
        super().__init__(model, optimizer, every, group, tracer)
        self.compress = compress
        self.quantize = Quantize(compress) if compress in ("int8", "fp8") else None
        # The anchors are fp32 copies of what this rank holds (sharded where that is).
        self.anchors = [t.detach().float().clone().requires_grad_(True) for t in self.tensors]
        build = outer_optimizer or partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        self.outer = build(self.anchors)

    def _synchronise(self) -> None:
        moved = [a.detach() - t.float() for a, t in zip(self.anchors, self.tensors, strict=True)]
        flat = _flatten(moved).div_(self.comm.world_size)  # the mean, summed below
        if self.comm.world_size > 1:
            flat = self._all_reduce(flat)
        _unflatten(flat, moved)
        for anchor, grad in zip(self.anchors, moved, strict=True):
            anchor.grad = grad
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for anchor, tensor in zip(self.anchors, self.tensors, strict=True):
            tensor.copy_(anchor.detach())

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.quantize is not None:
            return self.quantize.reduce(self.comm, "outer", flat, None).wait()
        if self.compress == "bf16":
            low = flat.to(torch.bfloat16)
            self.comm.all_reduce(low)
            return low.float()
        self.comm.all_reduce(flat)
        return flat

    def state_tensors(self) -> list[torch.Tensor]:
        """The anchor, the outer optimizer's state and the outer residual (this rank's)."""
        state = [v for s in self.outer.state.values() for v in s.values() if torch.is_tensor(v)]
        residual = self.quantize.state_tensors() if self.quantize is not None else []
        return [a.detach() for a in self.anchors] + state + residual

    def state_dict(self) -> tuple[list[dict], dict[str, torch.Tensor]]:
        shared = [
            {"anchor": anchor.detach(), **self.outer.state.get(anchor, {})}
            for anchor in self.anchors
        ]
        local = keyed_tensors(self.quantize.stores()) if self.quantize is not None else {}
        return shared, local

    @torch.no_grad()
    def load_state_dict(self, steps: int, shared: list[dict], local: dict) -> None:
        super().load_state_dict(steps, shared, local)
        for anchor, entries in zip(self.anchors, shared, strict=True):
            for key, value in entries.items():
                if key == "anchor":
                    anchor.copy_(value.view_as(anchor))
                else:
                    self.outer.state[anchor][key] = value.view_as(anchor).clone()
        if self.quantize is not None:
            load_keyed_tensors(self.quantize.stores(), local)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()

"""Where a sharded model's reduced gradients live, and the `ShardedGrad` placeholders' life.

The gradient of a parameter under ZeRO-1/2/3 lives in a piece's `.grad` in a flat shard, or in
an owner's whole master ([Note: whole parameters] in owners.py): `HeldGrads` finds this rank's
runs of it for a `ShardedGrad` ([Note: sharded gradients] in sharded_grads.py). `ShardedGrads`
attaches the placeholders at the end of a synchronised round, reconciles them with what the
user did to the model's `.grad` before a step or a forward, and drops them before a training
forward. The API's own reads (`held_runs`, `clip_grad_value_`, `grad_norms`) are here too.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...comm import Comm
from .sharded_grads import ShardedGrad, sharded_grad


class HeldGrads:
    """Where this rank's runs of each parameter's reduced gradient live ([Note: sharded
    gradients]): a piece's `.grad` in a flat shard, or an owner's whole master `.grad`.

    holders: what holds the flat shards (ZeRO-1/2's buckets, ZeRO-3's units: `.shard`,
        `.params`); owned: id(parameter) -> its `Owned` (the strategy keeps it up to date);
    comm: the shard group, over which the runs are disjoint.
    """

    def __init__(self, holders: list, owned: dict, comm: Comm):
        self.owned = owned
        self.comm = comm
        self.lay(holders)

    def lay(self, holders: list) -> None:
        """Where each parameter lies (again, after its buckets were re-planned)."""
        self.where = {id(p): (h.shard, i) for h in holders for i, p in enumerate(h.params)}

    def runs(self, param: nn.Parameter) -> list[torch.Tensor]:
        owned = self.owned.get(id(param))
        if owned is not None:
            master = owned.master
            return [master.grad] if master is not None and master.grad is not None else []
        shard, i = self.where[id(param)]
        piece = shard.pieces[i]
        return [piece.grad] if piece is not None and piece.grad is not None else []

    def clear(self, param: nn.Parameter) -> None:
        """The parameter's gradient is gone (its placeholder was set to None)."""
        owned = self.owned.get(id(param))
        if owned is not None:
            if owned.master is not None:
                owned.master.grad = None
            return
        shard, i = self.where[id(param)]
        if shard.pieces[i] is not None:
            shard.pieces[i].grad = None

    def clear_all(self, set_to_none: bool) -> None:
        """Every parameter's gradient is gone, or zeroed: `model.zero_grad()` wherever the user
        calls it, between a forward and its backward too, where the placeholders are already
        off `.grad` and setting it to None would tell nothing ([Note: cleared after the
        forward] in reducer.py)."""
        for key, (shard, i) in self.where.items():
            owned = self.owned.get(key)
            holder = owned.master if owned is not None else shard.pieces[i]
            if holder is None or holder.grad is None:
                continue
            if set_to_none:
                holder.grad = None
            else:
                holder.grad.zero_()


class ShardedGrads:
    """The `ShardedGrad` of each of a strategy's parameters, made once and reused.

    params: the parameters whose reduced gradient lives in flat shards, in the order of the
        round's used flags (frozen ones are skipped).
    strategy: its name, for the errors. `source` (a `HeldGrads`) is set by the strategy.
    """

    def __init__(self, params: list[nn.Parameter], strategy: str):
        self.params = params
        self.strategy = strategy
        self.source: HeldGrads | None = None
        self.grads: list[ShardedGrad | None] = [None] * len(params)
        # (dtype, device) each was made for: read from the parameter, as a ShardedGrad's own
        # attribute reads go through its __torch_function__ (two per parameter per step)
        self.made_for: list[tuple | None] = [None] * len(params)
        self.attached: list[int] = []  # positions given a placeholder at the last round's end

    def attach(self, used: list[bool]) -> None:
        """At the end of a synchronised round: the parameters some rank used get theirs (made
        in the parameter's dtype now: ZeRO-3's parameters take the compute dtype)."""
        attached = [
            i
            for i, (param, was_used) in enumerate(zip(self.params, used, strict=True))
            if was_used and param.requires_grad
        ]
        params, grads, made_for = self.params, self.grads, self.made_for
        for i in attached:
            param = params[i]
            key = (param.dtype, param.device)
            if made_for[i] != key:
                grads[i] = sharded_grad(param, self.source, self.strategy)
                made_for[i] = key
            param.grad = grads[i]
        self.attached = attached

    def reconcile(self) -> None:
        """Before a step: a placeholder the user set to None (`model.zero_grad()`) clears its
        parameter's gradient, as in one process; one replaced by another tensor is refused.
        One pass over the attached ones, nothing more when none changed (every step)."""
        params, grads = self.params, self.grads
        changed = [i for i in self.attached if params[i].grad is not grads[i]]
        for i in changed:
            self._gone(i)
        if changed:
            self.attached = [i for i in self.attached if params[i].grad is grads[i]]

    def drop(self) -> None:
        """Before a training forward: autograd must find None (or a real gradient); a
        placeholder the user changed meanwhile is reconciled first."""
        params, grads = self.params, self.grads
        for i in self.attached:
            param = params[i]
            if param.grad is grads[i]:
                param.grad = None
            else:
                self._gone(i)
        self.attached = []

    def _gone(self, i: int) -> None:
        param = self.params[i]
        if param.grad is None:
            self.source.clear(param)
            return
        raise ValueError(
            f"a model parameter's .grad (shape {list(param.shape)}) was replaced by another "
            f"tensor under {self.strategy}, where the reduced gradient lives sharded; change it "
            "in place (p.grad.mul_(...)), or clear it with zero_grad"
        )


# -- what works: the reduced gradient where it lives ------------------------------------------
def held_runs(holders: list) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(model parameter, this rank's run of its reduced gradient) for every piece that holds a
    gradient; `holders` have `.shard` (FlatShard) and `.params` (ZeRO-1/2 buckets, ZeRO-3
    units)."""
    runs = []
    for holder in holders:
        for piece, param in zip(holder.shard.pieces, holder.params, strict=True):
            if piece is not None and piece.grad is not None:
                runs.append((param, piece.grad))
    return runs


@torch.no_grad()
def clip_grad_value_(grads: list[torch.Tensor], clip_value: float) -> None:
    """Clamp every element into [-clip_value, clip_value]: elementwise, so clamping each
    rank's runs is exactly the one-process clamp (torch.nn.utils.clip_grad_value_'s)."""
    clip_value = float(clip_value)
    for grad in grads:
        grad.clamp_(min=-clip_value, max=clip_value)


@torch.no_grad()
def grad_norms(
    runs: list[tuple[nn.Parameter, torch.Tensor]],
    names: dict[int, str],
    norm_type: float,
    comm: Comm | None,
) -> dict[str, torch.Tensor]:
    """Per parameter name, the norm of its reduced gradient: each rank's runs' p-th powers
    (or maxima), one all-reduce over `comm` (None: every rank holds every gradient whole).
    Parameters without a gradient are left out, as a `.grad` of None would be."""
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    order = [i for i in names if i in {id(p) for p, _ in runs}] if comm is None else list(names)
    slot = {i: k for k, i in enumerate(order)}
    device = comm.device if comm is not None else (runs[0][1].device if runs else "cpu")
    parts = torch.zeros(2 * len(order), dtype=torch.float32, device=device)
    for param, grad in runs:
        k = slot[id(param)]
        norm = torch.linalg.vector_norm(grad, norm_type).float().to(device)
        parts[2 * k] = torch.maximum(parts[2 * k], norm) if inf else parts[2 * k] + norm**norm_type
        parts[2 * k + 1] = 1.0  # this rank holds a gradient of it
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(parts, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    values, held = parts[0::2], parts[1::2]
    norms = values if inf else values.pow(1.0 / norm_type)
    return {names[i]: norms[k].cpu() for i, k in slot.items() if held[k] > 0}

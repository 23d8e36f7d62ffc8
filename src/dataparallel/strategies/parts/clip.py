"""Clipping by the global gradient norm when each rank holds a part of the gradients.

Each rank computes the norm of what it holds; one all-reduce over the shard group combines them
(the p-th powers summed, or the maximum for the inf-norm); every rank scales its own part.
Replicas of a 2-D mesh hold the same shard, so they are not counted twice. With a shard group
of one rank (DDP, where every rank holds the same reduced gradients) it is torch's own clip.

Tensor-parallel parameters ([Note: tensor-parallel parameters] in tensor_parallel.py) add one
step: the gradient of a parameter sharded over "tp" is split across the tp ranks too, so its
p-th powers are also summed over the groups of its Shard dimensions (`spread`), while one
replicated over "tp" is counted once. Each distinct spread is summed separately, then all are
added: the norm of the whole model, over every dimension.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...comm import Comm
from .tensor_parallel import Spread, all_spreads, spread_of


@torch.no_grad()
def clip_grad_norm_(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    comm: Comm | None,
    spread: list[Spread] | None = None,
    spreads: tuple[Spread, ...] = (),
) -> torch.Tensor:
    """Scale `grads` (this rank's part) so the global norm is at most `max_norm`; return it.

    comm: the group over which the ranks' parts are disjoint (None: every rank holds them all).
    spread: per gradient, the tensor-parallel groups its parameter is sharded over (() none).
    spreads: every distinct non-empty spread of the model, in one order on every rank (each is
        summed over its groups even by a rank that holds no gradient of it).
    """
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = comm.device if comm is not None else (grads[0].device if grads else "cpu")
    slot = {key: 1 + i for i, key in enumerate(spreads)}
    norms: list[list[torch.Tensor]] = [[] for _ in range(1 + len(spreads))]
    for i, g in enumerate(grads):
        index = slot[spread[i]] if spread is not None and spread[i] else 0
        norms[index].append(torch.linalg.vector_norm(g, norm_type).float())
    parts = []
    for held in norms:
        if not held:
            parts.append(torch.zeros((), dtype=torch.float32))
            continue
        stacked = torch.stack(held)
        parts.append(stacked.max() if inf else stacked.pow(norm_type).sum())
    totals = torch.stack([t.to(device) for t in parts])  # NCCL needs it on the GPU
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    if comm is not None and comm.world_size > 1:
        with comm.tracer.labelled(what="gradient norm"):
            comm.all_reduce(totals, op=op)
    for key, index in slot.items():
        part = totals[index : index + 1].clone()
        for group in key:  # a few bytes each, over the tensor-parallel dimensions
            dist.all_reduce(part, op=op, group=group)
        totals[index] = part[0]
    total = totals.max() if inf else totals.sum().pow(1.0 / norm_type)
    # torch.nn.utils.clip_grad_norm_'s formula, so clipped runs match single-process ones
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def clip_shards_(
    shards: list,
    params: list,
    max_norm: float,
    norm_type: float,
    comm: Comm,
    owned=(),
    managed: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Clip the gradients of flat shards, `shards` of (FlatShard, its parameters), held over
    `comm`; `params`: every parameter of the model (their tensor-parallel spreads); `owned`:
    the gradients of the whole masters this rank owns ([Note: optimizer layout] in optimizer_layout.py;
    one owner per parameter in the group, so each counts once); `managed`: the ids of every
    owned parameter, whichever rank owns it: their pieces in the shards are scaled but not
    counted (the owner's whole gradient counts them; counted twice, Muon's matrices made the
    norm too large and the clip too strong, 1.5e-3 off one process under Lightning's
    gradient_clip_val)."""
    spreads = all_spreads(params)
    if not spreads and not managed:  # the whole store at once where it can
        grads = [g for shard, _ in shards for g in shard.grad_tensors()] + list(owned)
        return clip_grad_norm_(grads, max_norm, norm_type, comm)
    grads, spread, scaled = list(owned), [()] * len(owned), []
    for shard, owners in shards:
        for piece, param in zip(shard.pieces, owners, strict=True):
            if piece is None or piece.grad is None:
                continue
            if id(param) in managed:
                scaled.append(piece.grad)
                continue
            grads.append(piece.grad)
            spread.append(spread_of(param))
    total = clip_grad_norm_(grads, max_norm, norm_type, comm, spread, spreads)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in scaled:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def clip_replicated_(params: list, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip gradients every data-parallel rank holds whole and equal (DDP's)."""
    spreads = all_spreads(params)
    held = [p for p in params if p.grad is not None]
    if not spreads:
        return torch.nn.utils.clip_grad_norm_(held, max_norm, norm_type=norm_type)
    grads, spread = [p.grad for p in held], [spread_of(p) for p in held]
    return clip_grad_norm_(grads, max_norm, norm_type, None, spread, spreads)

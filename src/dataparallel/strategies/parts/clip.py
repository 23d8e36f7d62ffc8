"""Clipping by the global gradient norm when each rank holds a part of the gradients.

Each rank computes the norm of what it holds; one all-reduce over the shard group combines them
(the p-th powers summed, or the maximum for the inf-norm); every rank scales its own part.
Replicas of a 2-D mesh hold the same shard, so they are not counted twice. With a shard group
of one rank (DDP, where every rank holds the same reduced gradients) it is torch's own clip.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...comm import Comm


@torch.no_grad()
def clip_grad_norm_(
    grads: list[torch.Tensor], max_norm: float, norm_type: float, comm: Comm
) -> torch.Tensor:
    """Scale `grads` (this rank's part) so the global norm is at most `max_norm`; return it."""
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=comm.device)  # NCCL needs it on the GPU
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in grads])
        local = norms.max() if inf else norms.pow(norm_type).sum()
        total = local.to(comm.device)
    if comm.world_size > 1:
        with comm.tracer.labelled(what="gradient norm"):
            comm.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    if not inf:
        total = total.pow(1.0 / norm_type)
    # torch.nn.utils.clip_grad_norm_'s formula, so clipped runs match single-process ones
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total

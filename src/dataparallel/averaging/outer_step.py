"""DiLoCo's outer step: the anchors (fp32 copies of the held tensors as the last
synchronisation left them) and the outer optimizer that moves them by the outer gradient, the
replicas' mean movement since ([Note: averaging] in local_sgd.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .flat import Reduced, flatten, unflatten
from .outer_wire import OuterWire


class OuterStep:
    """The anchors of `tensors` and their outer optimizer; each verb takes a part (positions
    in `tensors`: a fragment, or every tensor).

    tensors: what this rank holds (`held_tensors`); the anchors are fp32 copies of them, so
        sharded wherever they are.
    build: the outer optimizer from a list of tensors (None: Nesterov SGD, lr 0.7, momentum
        0.9, the paper's setting).
    wire: how the outer gradients travel (`OuterWire`).
    """

    def __init__(self, tensors: list[torch.Tensor], build: Callable | None, wire: OuterWire):
        self.tensors, self.wire = tensors, wire
        self.anchors = [t.detach().float().clone().requires_grad_(True) for t in tensors]
        build = build or partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        self.optimizer = build(self.anchors)

    def gradient(self, part: list[int], key: str) -> Reduced:
        """All-reduce the part's outer gradient, the replicas' mean movement since its anchors
        (asynchronously; `key` names its residual under error feedback)."""
        moved = [self.anchors[i].detach() - self.tensors[i].float() for i in part]
        flat = flatten(moved).div_(self.wire.comm.world_size)  # the mean, summed below
        return self.wire.all_reduce(flat, key)

    def apply(self, part: list[int], flat: torch.Tensor, overlap: int, mix: float) -> None:
        """The outer step on the part's anchors with the reduced outer gradient `flat`; the
        part's tensors continue from the result (with `overlap`, mixed: `mix` x their local
        values + (1 - mix) x the result)."""
        grads = [torch.empty_like(self.anchors[i]) for i in part]
        unflatten(flat, grads)
        for i, grad in zip(part, grads, strict=True):
            self.anchors[i].grad = grad
        self.optimizer.step()  # only the part's anchors have a gradient: only they move
        self.optimizer.zero_grad(set_to_none=True)
        for i in part:
            anchor, tensor = self.anchors[i].detach(), self.tensors[i]
            if overlap:
                tensor.mul_(mix).add_(anchor.to(tensor.dtype), alpha=1 - mix)
            else:
                tensor.copy_(anchor)

    def average(self, part: list[int] | range, key: str) -> None:
        """The replicas' mean of the part, its anchors and tensors set to it: in fp32 the
        parameters are averaged; compressed, the movement since the anchors travels (with its
        own error feedback under `key`) and the anchors move by its mean."""
        comm = self.wire.comm
        anchors = [self.anchors[i].detach() for i in part]
        tensors = [self.tensors[i] for i in part]
        if self.wire.compress is None:
            flat = flatten(tensors).div_(comm.world_size)
            if comm.world_size > 1:
                comm.all_reduce(flat)
            unflatten(flat, tensors)
            for anchor, tensor in zip(anchors, tensors, strict=True):
                anchor.copy_(tensor)
        else:
            moved = [a - t.float() for a, t in zip(anchors, tensors, strict=True)]
            flat = self.wire.all_reduce(flatten(moved).div_(comm.world_size), key).wait()
            unflatten(flat, moved)
            for anchor, step, tensor in zip(anchors, moved, tensors, strict=True):
                anchor.sub_(step)
                tensor.copy_(anchor)

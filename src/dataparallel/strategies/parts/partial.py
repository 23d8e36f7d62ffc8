"""A reduction of a sharded gradient, whose ranks' parts combine when its value is used.

[Note: partial values] Under ZeRO-1/2/3 each rank holds a part of a parameter's reduced
gradient ([Note: sharded gradients] in sharded_grads.py). A reduction of it (`p.grad.norm()`,
`.sum()`, `.max()`) is computed over each rank's part, which gives a partial value: the parts
combine over the shard group in one all-reduce (a sum of p-th powers for a p-norm, a sum, a
maximum, a minimum), then over the tensor-parallel groups its parameter is split across. As
with DTensor's `Partial` placement (FSDP2's answer to the same reads), the all-reduce waits
until the value is used, and reductions of partial values stay partial: PyTorch's
`clip_grad_norm_`, which takes each gradient's norm (`torch.linalg.vector_norm`, one per
parameter) and then the norm of their stack, pays one all-reduce for the whole model, not one
per parameter. Any other use (arithmetic, `.item()`, printing, a comparison, `float()`)
combines the value first, once, and keeps it.

The all-reduce is a collective: the ranks of the shard group must use their partial values in
the same order, as they do when every rank runs the same script (a logging loop over
`model.named_parameters()`, the clip line). A value used on one rank alone (`if rank == 0:
print(p.grad.norm())`) waits there for the others until the collective timeout, whose error
names the collective; compute it on every rank and print it on one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...comm import Comm
from ...torch_internals import make_subclass, no_subclass_dispatch
from .grad_ops import METADATA, name_of

# How each kind of partial value combines across ranks.
OPS = {
    "power": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class Partial(torch.Tensor):
    """A reduction not yet combined across ranks ([Note: partial values]); make with
    `partial`.

    local: this rank's part (float64 for sums, so a sum of many parts rounds as one would).
    kind: "power" (a p-norm's sum of p-th powers; the max of |x| for the inf-norm), "sum",
        "max" or "min".
    order: the p of a "power" value (math.inf: combined by max).
    count: what the combined sum is divided by (a mean's element count), or 1.
    comm: the shard group; spread: the tensor-parallel groups the parameter is split over.
    """

    local: torch.Tensor
    kind: str
    order: float
    count: int
    comm: Comm | None
    spread: tuple
    value: torch.Tensor | None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if name_of(func) in METADATA:
            with no_subclass_dispatch():
                return func(*args, **kwargs)
        kept = _stays_partial(func, args, kwargs)
        if kept is not None:
            return kept
        args, kwargs = _combined((args, kwargs))
        with no_subclass_dispatch():
            return func(*args, **kwargs)

    def combine(self) -> torch.Tensor:
        """The value: every rank's part combined (collective, once; kept after)."""
        if self.value is None:
            total = self.local.clone()
            inf_norm = self.kind == "power" and math.isinf(self.order)  # combined by max
            op = dist.ReduceOp.MAX if inf_norm else OPS[self.kind]
            if self.comm is not None and self.comm.world_size > 1:
                with self.comm.tracer.labelled(what="gradient reduction"):
                    self.comm.all_reduce(total, op=op)
            for group in self.spread:  # a few bytes each, over the tensor-parallel groups
                dist.all_reduce(total, op=op, group=group)
            if self.kind == "power" and not math.isinf(self.order):
                total = total.pow(1.0 / self.order)
            elif self.count != 1:
                total = total / self.count
            with no_subclass_dispatch():
                self.value = total.to(self.dtype)
        return self.value


def partial(
    local: torch.Tensor,
    kind: str,
    dtype: torch.dtype,
    comm: Comm | None,
    spread: tuple = (),
    order: float = 2.0,
    count: int = 1,
) -> Partial:
    """A `Partial` of `local` (shape = the value's), reading as `dtype` once combined."""
    base = torch.zeros((), dtype=dtype, device=local.device).expand(local.shape)
    out = make_subclass(Partial, base)
    out.local, out.kind, out.order, out.count = local, kind, float(order), count
    out.comm, out.spread, out.value = comm, spread, None
    return out


def _combined(tree):
    """`tree` (args and kwargs, lists and tuples inside) with each Partial's value."""
    if isinstance(tree, Partial):
        return tree.combine()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_combined(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _combined(v) for k, v in tree.items()}
    return tree


def _stays_partial(func, args, kwargs) -> Partial | None:
    """The calls that keep a value partial ([Note: partial values]): torch's clip stacks the
    per-gradient norms and takes their norm; `.to` the same device moves nothing. None: the
    call needs the combined value."""
    if func is torch.stack and not kwargs.get("dim") and len(args) == 1:
        parts = list(args[0])
        if parts and all(isinstance(t, Partial) and t.value is None for t in parts):
            first = parts[0]
            if all(_alike(first, t) and t.local.dim() == 0 for t in parts):
                return _like(first, torch.stack([t.local for t in parts]))
        return None
    if func is torch.Tensor.to:
        self, rest = args[0], (*args[1:], *kwargs.values())
        if self.value is None and all(_same_place(self, r) for r in rest):
            return self
        return None
    if func in (torch.linalg.vector_norm, torch.Tensor.norm, torch.norm):
        self = args[0]
        order = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else 2.0))
        order = 2.0 if order in (None, "fro") else order
        dims = kwargs.get("dim", args[2] if len(args) > 2 else None)
        if (
            self.kind == "power"
            and self.value is None
            and dims is None
            and not isinstance(order, str)
            and float(order) == self.order
            and not kwargs.get("keepdim")
            and kwargs.get("dtype") is None
        ):  # the norm of per-gradient norms: the norm of all their elements
            local = self.local.max() if math.isinf(self.order) else self.local.sum()
            return _like(self, local)
    return None


def _alike(a: Partial, b: Partial) -> bool:
    return (a.kind, a.order, a.count, a.comm, a.spread, a.dtype) == (
        b.kind,
        b.order,
        b.count,
        b.comm,
        b.spread,
        b.dtype,
    )


def _like(model: Partial, local: torch.Tensor) -> Partial:
    return partial(
        local, model.kind, model.dtype, model.comm, model.spread, model.order, model.count
    )


def _same_place(value: Partial, arg) -> bool:
    """Whether a `.to(arg)` argument leaves the value where it is (same device, dtype)."""
    if isinstance(arg, (torch.device, str)):
        return torch.device(arg) == value.device
    if isinstance(arg, torch.dtype):
        return arg == value.dtype
    return arg is None or isinstance(arg, bool)

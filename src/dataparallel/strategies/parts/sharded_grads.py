"""What a model parameter's `.grad` is under sharding, and the calls that read the real one.

[Note: sharded gradients] After a synchronised backward under ZeRO-1/2/3 the reduced gradient
of a parameter is a run of flat shards spread over the shard group ([Note: flat shard]): the
optimizer's pieces hold it, and no rank holds it whole. PyTorch's own utilities read the
model's `.grad`: `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`, the clipping line of
nearly every training script, `clip_grad_value_`, a logged `p.grad.norm()`. Left None (as
before), they clipped nothing and returned 0 without a word (0.77 from one process where the
parameters moved 0.11, issue 29); left as the local sums, they read the wrong gradient
([Note: consumed sums] in zero12/keepers.py). A DTensor gradient, FSDP2's answer, cannot
describe a run of a flat shard. So each parameter that some rank used in the round gets a
`ShardedGrad` as `.grad`: a zero-stride tensor of the parameter's shape, dtype and device (no
memory) whose every use raises one line naming the call and the ways that work
(`dataparallel.clip_grad_norm_(model, max_norm)`, `dataparallel.clip_grad_value_(model,
clip_value)`, `dataparallel.grad_norms(model)`). Its metadata (shape, dtype, device) reads as
the gradient's, so `p.grad is not None` stays true as in one process and a script that sums
`p.grad.norm()` over the parameters fails instead of summing zero. The error is raised on the
rank that reads, with no collective: a read on one rank alone fails there and hangs nobody.
`model.zero_grad()` clears it (set_to_none, or zeros: a no-op); the strategy drops it before
the next training forward, so autograd never accumulates into it; a parameter no rank used
keeps `.grad = None`, as in one process. DDP keeps ordinary reduced `.grad`, on which
PyTorch's utilities give the one-process result.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import nn

from ...comm import Comm

# Reads of metadata only (true of the gradient), and the clears `nn.Module.zero_grad` makes.
METADATA = frozenset({"shape", "dtype", "device", "layout", "ndim", "is_sparse", "requires_grad"})
METADATA_CALLS = frozenset({"size", "dim", "numel", "__len__"})
CLEARS = frozenset({"zero_", "requires_grad_", "detach_", "_foreach_zero_"})


def _name(func) -> str:
    """`func`'s name: a property's own name for a property read."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:
        return getattr(owner, "__name__", "?")
    return getattr(func, "__name__", str(func))


def _caller(func) -> str:
    """The call to name in the error: the outermost torch function on the stack above this
    read, wrappers left out (`torch.nn.utils.clip_grad_norm_`; a private `_get_total_norm` is
    public `get_total_norm`), or the read itself (`.grad.norm`) when the user's code made it."""
    frame, outermost = sys._getframe(2), None
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
        name = frame.f_code.co_name
        if not name.startswith("<") and "wrapper" not in name and name != "decorate_context":
            outermost = frame
        frame = frame.f_back
    module = outermost.f_globals["__name__"] if outermost is not None else "torch._tensor"
    if module.startswith(("torch._tensor", "torch.overrides", "torch.functional")):
        return f".grad.{_name(func)}"
    if module.startswith("torch.nn.utils"):
        module = "torch.nn.utils"
    return f"{module}.{outermost.f_code.co_name.lstrip('_')}"


class ShardedGrad(torch.Tensor):
    """A model parameter's `.grad` under ZeRO-1/2/3 after a synchronised round: every use
    raises ([Note: sharded gradients]). Build with `sharded_grad`."""

    strategy = "zero"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _name(func)
        if name in METADATA or name in METADATA_CALLS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if name == "grad_fn":
            return None
        if name in CLEARS:
            return args[0] if name != "_foreach_zero_" else None
        flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        strategy = next((t.strategy for t in flat if isinstance(t, ShardedGrad)), cls.strategy)
        raise RuntimeError(
            f"{_caller(func)} read a model parameter's .grad, which under {strategy} is not "
            "the reduced gradient (it lives sharded in the optimizer, no rank holds it whole); "
            "use dataparallel.clip_grad_norm_(model, max_norm), "
            "dataparallel.clip_grad_value_(model, clip_value) or dataparallel.grad_norms(model)"
        )


def sharded_grad(param: nn.Parameter, strategy: str) -> ShardedGrad:
    """A `ShardedGrad` for `param`: its shape, dtype and device, one element of memory."""
    base = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    grad = torch.Tensor._make_subclass(ShardedGrad, base)
    grad.strategy = strategy
    return grad


class ShardedGrads:
    """The `ShardedGrad` of each of a strategy's parameters, made once and reused.

    params: the parameters whose reduced gradient lives in flat shards, in the order of the
        round's used flags (frozen ones are skipped).
    strategy: its name, for the error.
    """

    def __init__(self, params: list[nn.Parameter], strategy: str):
        self.params = params
        self.strategy = strategy
        self.grads: list[ShardedGrad | None] = [None] * len(params)
        # (dtype, device) each was made for: read from the parameter, as a ShardedGrad's own
        # attribute reads go through its __torch_function__ (two per parameter per step)
        self.made_for: list[tuple | None] = [None] * len(params)

    def attach(self, used: list[bool]) -> None:
        """At the end of a synchronised round: the parameters some rank used get theirs (made
        in the parameter's dtype now: ZeRO-3's parameters take the compute dtype)."""
        for i, (param, was_used) in enumerate(zip(self.params, used, strict=True)):
            if not was_used or not param.requires_grad:
                continue
            key = (param.dtype, param.device)
            if self.made_for[i] != key:
                self.grads[i] = sharded_grad(param, self.strategy)
                self.made_for[i] = key
            param.grad = self.grads[i]

    def drop(self) -> None:
        """Before a training forward: autograd must find None (or a real gradient)."""
        for param in self.params:
            if isinstance(param.grad, ShardedGrad):
                param.grad = None


def is_sharded_grad(grad) -> bool:
    return isinstance(grad, ShardedGrad)


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

"""What a model parameter's `.grad` is under sharding: the reduced gradient where it lives.

[Note: sharded gradients] After a synchronised backward under ZeRO-1/2/3 the reduced gradient
of a parameter is a run of flat shards spread over the shard group ([Note: flat shard]), or a
whole tensor on its owner ([Note: whole parameters] in owners.py): no rank holds it whole, yet
scripts read the model's `.grad` with PyTorch's own lines, `torch.nn.utils.clip_grad_norm_(
model.parameters(), ...)`, `clip_grad_value_`, a logged `p.grad.norm()`. Left None, they
clipped nothing and returned 0 without a word (issue 29); left as the local sums, they read the
wrong gradient ([Note: consumed sums] in parts/keepers.py). So each parameter that some rank
used in the round gets a `ShardedGrad` as `.grad`: a tensor of the parameter's shape, dtype and
device (no memory of its own) that reads this rank's runs of the reduced gradient when it is
used, as FSDP2's DTensor gradients do:
- a reduction without `dim` (`norm`, `torch.linalg.vector_norm`, `torch._foreach_norm`, `sum`,
  `mean`, `max`, `min`, `amax`, `amin`, `any`, `all`, `count_nonzero`) gives a `Partial`, whose
  ranks' parts combine over the shard group when it is used ([Note: partial values] in
  partial.py): the global value, in a collective every rank joins; `std` and `var` combine at
  once (two all-reduces);
- an elementwise function of it (`abs`, `pow`, `* 2`, `float()`, `isfinite`, a comparison with
  a number) is another `ShardedGrad` over the results, reduced the same way;
- an in-place change (`mul_`, `div_`, `clamp_`, `zero_`, `nan_to_num_`, their `_foreach_` forms)
  changes the runs themselves: PyTorch's clip scales the gradient the optimizer steps with.
So `clip_grad_norm_` and `clip_grad_value_` give the one-process result and `p.grad.norm()` the
global norm. What cannot be exact on one rank (an element, `tolist()`, a matrix product, a
whole tensor beside it, `torch.save`) raises one line naming the call. Metadata (shape, dtype,
device) reads true, so `p.grad is not None` holds as in one process.

Clearing: `model.zero_grad(set_to_none=False)` zeroes the runs; `model.zero_grad()` (or any
`p.grad = None`) removes the placeholder, and the strategy, finding it gone at the next step or
forward (`ShardedGrads.reconcile`, held_grads.py), clears that parameter's gradient, so a loop that zeroes the
model instead of the optimizer (the Hugging Face Trainer's) trains as in one process. A
placeholder replaced by another tensor is refused there in one line. A parameter no rank used
keeps `.grad = None`; DDP keeps ordinary reduced `.grad`, on which PyTorch's own code runs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...comm import Comm
from ...torch_internals import caller_frame, make_subclass, no_subclass_dispatch
from .grad_ops import (
    ELEMENTWISE_OPS,
    IN_PLACE_OPS,
    ITSELF,
    METADATA,
    REDUCTIONS,
    arguments,
    name_of,
)
from .partial import Partial, partial
from .tensor_parallel import spread_of


def _caller(func) -> str:
    """The call to name in the error: the outermost torch function on the stack above this
    read, wrappers left out, or the read itself (`.grad.tolist`) when the user's code made it."""
    frame, outermost = caller_frame(2), None
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
        name = frame.f_code.co_name
        if not name.startswith("<") and "wrapper" not in name and name != "decorate_context":
            outermost = frame
        frame = frame.f_back
    module = outermost.f_globals["__name__"] if outermost is not None else "torch._tensor"
    if module.startswith(("torch._tensor", "torch.overrides", "torch.functional")):
        return f".grad.{name_of(func)}"
    if module.startswith("torch.nn.utils"):
        module = "torch.nn.utils"
    return f"{module}.{outermost.f_code.co_name.lstrip('_')}"


class ShardedGrad(torch.Tensor):
    """A model parameter's `.grad` under ZeRO-1/2/3 after a synchronised round ([Note: sharded
    gradients]). Build with `sharded_grad`.

    source: where this rank's runs of the reduced gradient live (a `HeldGrads`, held_grads.py;
        its `runs(param)` and `comm`), None for a derived one; param: its parameter; fixed: a derived gradient's own runs.
    """

    source: object | None  # a HeldGrads (held_grads.py)
    param: nn.Parameter
    fixed: list[torch.Tensor] | None
    spread: tuple
    strategy: str

    def runs(self) -> list[torch.Tensor]:
        """This rank's runs of the gradient, now."""
        if self.fixed is not None:
            return self.fixed
        return self.source.runs(self.param) if self.source is not None else []

    @property
    def comm(self) -> Comm | None:
        return self.source.comm if self.source is not None else None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = name_of(func)
        if name in METADATA:
            with no_subclass_dispatch():
                return func(*args, **kwargs)
        if name == "grad_fn":
            return None
        if name in ITSELF and isinstance(args[0], ShardedGrad):
            return args[0]
        first = _first_grad(args)
        try:
            if name in REDUCTIONS:
                return _reduce(first, name, args, kwargs)
            if name in IN_PLACE_OPS:
                _in_place(func, args, kwargs)
                return args[0]
            if name in ELEMENTWISE_OPS:
                return _elementwise(first, func, args, kwargs)
        except _Inexact:
            pass
        raise RuntimeError(
            f"{_caller(func)} on a model parameter's .grad cannot be exact under "
            f"{first.strategy}: this rank holds only its part of the reduced gradient; "
            "reductions (norm, sum, mean, max, min), elementwise maths with numbers, in-place "
            "scaling and torch.nn.utils.clip_grad_norm_/clip_grad_value_ work (collectives: "
            "every rank runs them; docs/zero.md)"
        )


class _Inexact(Exception):
    """A call on sharded gradients that has no exact form here (refused by the caller)."""


def sharded_grad(param: nn.Parameter, source, strategy: str) -> ShardedGrad:
    """A `ShardedGrad` for `param`: its shape, dtype and device, one element of memory."""
    base = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    return _made(base, source, param, None, spread_of(param), strategy)


def _made(base, source, param, fixed, spread, strategy) -> ShardedGrad:
    grad = make_subclass(ShardedGrad, base)
    grad.source, grad.param, grad.fixed, grad.spread = source, param, fixed, spread
    grad.strategy = strategy
    return grad


def _first_grad(args) -> ShardedGrad:
    for a in args:
        if isinstance(a, ShardedGrad):
            return a
        if isinstance(a, (list, tuple)):
            found = next((t for t in a if isinstance(t, ShardedGrad)), None)
            if found is not None:
                return found
    raise _Inexact


def _scalar(value) -> bool:
    """A number or a one-element tensor: the same for every element, on every rank."""
    if isinstance(value, Partial):
        return value.dim() == 0
    if torch.is_tensor(value):
        return not isinstance(value, ShardedGrad) and value.numel() == 1
    return isinstance(value, (int, float, bool)) or value is None


def _per_run(value, grad: ShardedGrad, index: int):
    """`value` as it applies to run `index` of `grad`: the run itself for the same gradient,
    a number as it is; anything else has no exact per-run form."""
    if isinstance(value, ShardedGrad):
        if value is not grad and (value.param is not grad.param or value.fixed is not None):
            raise _Inexact
        return value.runs()[index]
    if isinstance(value, Partial):
        return value.combine()
    if _scalar(value) or isinstance(value, (torch.dtype, torch.device, str, torch.memory_format)):
        return value
    raise _Inexact


def _elementwise(grad: ShardedGrad, func, args, kwargs) -> ShardedGrad:
    """A function of the gradient element by element: a derived `ShardedGrad` of its runs."""
    runs = grad.runs()
    out = []
    for i in range(len(runs)):
        call = [_per_run(a, grad, i) for a in args]
        named = {k: _per_run(v, grad, i) for k, v in kwargs.items()}
        with no_subclass_dispatch():
            out.append(func(*call, **named))
    with no_subclass_dispatch():
        shaped = func(*[_shape_of(a) for a in args], **{k: _shape_of(v) for k, v in kwargs.items()})
    base = torch.zeros((), dtype=shaped.dtype, device=shaped.device).expand(grad.shape)
    return _made(base, grad.source, grad.param, out, grad.spread, grad.strategy)


def _shape_of(value):
    """A one-element stand-in with `value`'s dtype and device (for the result's dtype)."""
    if isinstance(value, ShardedGrad):
        with no_subclass_dispatch():
            return torch.zeros(1, dtype=value.dtype, device=value.device)
    if isinstance(value, Partial):
        return value.combine()
    return value


@torch.no_grad()
def _in_place(func, args, kwargs) -> None:
    """Change every run in place; `_foreach_` forms take a list of gradients (and per-tensor
    scalars)."""
    if name_of(func).startswith("_foreach_"):
        grads, rest = args[0], args[1:]
        for k, grad in enumerate(grads):
            if not isinstance(grad, ShardedGrad):
                raise _Inexact
            mine = [r[k] if isinstance(r, (list, tuple)) else r for r in rest]
            single = getattr(torch.Tensor, name_of(func).removeprefix("_foreach_"))
            _in_place(single, (grad, *mine), kwargs)
        return
    grad = args[0]
    if not isinstance(grad, ShardedGrad):
        raise _Inexact
    for i, run in enumerate(grad.runs()):
        call = [run, *(_per_run(a, grad, i) for a in args[1:])]
        named = {k: _per_run(v, grad, i) for k, v in kwargs.items()}
        with no_subclass_dispatch():
            func(*call, **named)


def _reduce(grad: ShardedGrad, name: str, args, kwargs):
    """A reduction over the whole gradient: this rank's part, combined when used."""
    if name == "_foreach_norm":
        order = arguments(name, args, kwargs)["ord"]
        return [_reduce(g, "linalg_vector_norm", (g, order), {}) for g in args[0]]
    bound = arguments(name, args, kwargs)
    if bound.get("dim") not in (None, (), []) or bound.get("keepdim"):
        raise _Inexact  # a reduction along a dimension of a gradient laid flat over the ranks
    if bound.get("matrix") and grad.dim() != 1:
        raise _Inexact
    runs = grad.runs()
    kind = REDUCTIONS[name]
    device, comm = grad.device, grad.comm
    if kind == "norm":
        order = bound.get("ord", 2.0)
        order = 2.0 if order in (None, "fro") else order
        if isinstance(order, str) or float(order) < 0:
            raise _Inexact
        order = float(order)
        if order == 0:  # the number of non-zero elements
            local = _total([(r != 0).sum() for r in runs], device)
            return partial(local, "sum", grad.dtype, comm, grad.spread)
        if math.isinf(order):
            local = _largest([r.abs().max() for r in runs if r.numel()], device, 0.0)
        else:
            local = _total(
                [torch.linalg.vector_norm(r, order).double() ** order for r in runs], device
            )
        return partial(local, "power", grad.dtype, comm, grad.spread, order=order)
    if kind in ("sum", "mean", "count"):
        values = [(r != 0).sum() if kind == "count" else r.sum(dtype=torch.float64) for r in runs]
        count = grad.numel() if kind == "mean" else 1
        dtype = torch.int64 if kind == "count" else _sum_dtype(grad.dtype)
        return partial(_total(values, device), "sum", dtype, comm, grad.spread, count=count)
    if kind in ("max", "min"):
        fill = -math.inf if kind == "max" else math.inf
        values = [r.max() if kind == "max" else r.min() for r in runs if r.numel()]
        if grad.dtype == torch.bool:
            fill = 0.0 if kind == "max" else 1.0
        local = _largest(values, device, fill) if kind == "max" else _smallest(values, device, fill)
        return partial(local, kind, grad.dtype, comm, grad.spread)
    if kind in ("any", "all"):
        values = [(r.any() if kind == "any" else r.all()).double() for r in runs]
        fill = 0.0 if kind == "any" else 1.0
        local = _largest(values, device, fill) if kind == "any" else _smallest(values, device, fill)
        return partial(local, "max" if kind == "any" else "min", torch.bool, comm, grad.spread)
    return _spread_of_values(grad, runs, bound, kind)


def _spread_of_values(grad: ShardedGrad, runs, bound: dict, kind: str) -> torch.Tensor:
    """`var` or `std` over every rank's elements: the mean first, then the squared deviations
    from it (two all-reduces, combined at once)."""
    n = grad.numel()
    sums = _total([r.sum(dtype=torch.float64) for r in runs], grad.device)
    mean = partial(sums, "sum", torch.float64, grad.comm, grad.spread, count=n).combine()
    squares = [(r.double() - mean).square().sum() for r in runs]
    total = partial(_total(squares, grad.device), "sum", torch.float64, grad.comm, grad.spread)
    correction = bound.get("correction")
    correction = (1 if bound.get("unbiased", True) else 0) if correction is None else correction
    variance = total.combine() / max(n - correction, 0)
    return (variance.sqrt() if kind == "std" else variance).to(grad.dtype)


def _total(values: list[torch.Tensor], device) -> torch.Tensor:
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([v.double() for v in values]).sum()


def _largest(values: list[torch.Tensor], device, fill: float) -> torch.Tensor:
    if not values:
        return torch.tensor(fill, dtype=torch.float64, device=device)
    return torch.stack([v.double() for v in values]).max()


def _smallest(values: list[torch.Tensor], device, fill: float) -> torch.Tensor:
    if not values:
        return torch.tensor(fill, dtype=torch.float64, device=device)
    return torch.stack([v.double() for v in values]).min()


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if not (dtype.is_floating_point or dtype.is_complex) else dtype


def is_sharded_grad(grad) -> bool:
    return isinstance(grad, ShardedGrad)

"""The torch calls a sharded gradient answers ([Note: sharded gradients] in sharded_grads.py),
by name, and how a reduction's arguments are read. Pure tables: no tensor is touched here."""

from __future__ import annotations

# Reads of metadata only (true of the value), answered without reading any element.
METADATA = frozenset(
    {
        *("shape", "dtype", "device", "layout", "ndim", "is_sparse", "requires_grad", "is_cuda"),
        *("size", "dim", "numel", "__len__", "is_floating_point", "element_size", "is_complex"),
    }
)
ITSELF = frozenset({"data", "detach", "detach_", "requires_grad_"})  # the gradient itself


def name_of(func) -> str:
    """`func`'s name: a property's own name for a property read."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:
        return getattr(owner, "__name__", "?")
    return getattr(func, "__name__", str(func))


# Reductions over every element (without `dim`), by torch's name for the call -> what it is.
REDUCTIONS = {
    "norm": "norm",
    "linalg_vector_norm": "norm",
    "linalg_norm": "norm",
    "_foreach_norm": "norm",
    "sum": "sum",
    "nansum": "sum",
    "mean": "mean",
    "count_nonzero": "count",
    "max": "max",
    "amax": "max",
    "min": "min",
    "amin": "min",
    "any": "any",
    "all": "all",
    "std": "std",
    "var": "var",
}

# Functions of each element alone: applied to every run, the result another sharded gradient.
ELEMENTWISE_OPS = frozenset(
    {
        *("abs", "__abs__", "neg", "__neg__", "sign", "square", "sqrt", "rsqrt", "exp", "log"),
        *("pow", "__pow__", "mul", "__mul__", "__rmul__", "div", "__truediv__", "true_divide"),
        *("add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "clamp", "clip"),
        *("float", "double", "half", "bfloat16", "to", "cpu", "cuda", "clone", "contiguous"),
        *("isnan", "isinf", "isfinite", "nan_to_num", "logical_not", "__invert__"),
        *("eq", "ne", "gt", "lt", "ge", "le", "__eq__", "__ne__", "__gt__", "__lt__"),
        *("__ge__", "__le__", "maximum", "minimum"),
    }
)

# In-place changes of each element alone: applied to every run (the gradient itself).
IN_PLACE_OPS = frozenset(
    {
        *("mul_", "div_", "add_", "sub_", "clamp_", "clip_", "clamp_min_", "clamp_max_"),
        *("zero_", "nan_to_num_", "__imul__", "__itruediv__"),
        *("_foreach_mul_", "_foreach_div_", "_foreach_add_", "_foreach_sub_", "_foreach_zero_"),
        *("_foreach_clamp_min_", "_foreach_clamp_max_"),
    }
)

# The positional parameters of each reduction after the tensor, as torch declares them.
_POSITIONAL = {
    "norm": ("ord", "dim", "keepdim", "dtype"),
    "linalg_vector_norm": ("ord", "dim", "keepdim"),
    "linalg_norm": ("ord", "dim", "keepdim"),
    "_foreach_norm": ("ord",),
    "std": ("dim", "unbiased", "keepdim"),
    "var": ("dim", "unbiased", "keepdim"),
    "count_nonzero": ("dim",),
}
_DEFAULTS = {
    "norm": {"ord": "fro"},
    "linalg_vector_norm": {"ord": 2.0},
    "_foreach_norm": {"ord": 2.0},
}


def arguments(name: str, args: tuple, kwargs: dict) -> dict:
    """A reduction's arguments by name (`p` read as `ord`; `std(True)` as `unbiased`); the
    tensor (or list of tensors) itself is left out."""
    names = _POSITIONAL.get(name, ("dim", "keepdim"))
    rest = list(args[1:])
    if name in ("std", "var") and rest and isinstance(rest[0], bool):
        rest = [None, *rest]  # std(unbiased)
    if name in ("max", "min") and rest and not isinstance(rest[0], (int, tuple, list)):
        return {"dim": "other"}  # max(other): elementwise against a tensor, not a reduction
    bound = dict(_DEFAULTS.get(name, {}))
    bound.update(zip(names, rest, strict=False))
    for key, value in kwargs.items():
        bound["ord" if key == "p" else key] = value
    if name == "linalg_norm" and bound.get("ord") is not None:
        bound["matrix"] = True  # a matrix norm of a 2-D gradient: not a norm of its elements
    return bound

"""torch's private APIs, each behind one wrapper: a torch upgrade is a one-file audit.

Every use of a name torch does not promise (a leading underscore, `torch._C`, a `_private`
module) lives here and nowhere else in the package (tests/unit/test_torch_internals.py holds
that rule and tests each wrapper on the installed torch). Each docstring says what it reaches
into, why no public form serves, and the versions it was checked on:
- "2.13" is torch 2.13.0+cpu, this project's pinned wheel: the wrapper's own unit test;
- "2.11" is torch 2.11.0+cu130 on the GPU machine (BENCHMARKS.md, "GPU check": its unit tests
  and the GPU check ran the code that calls the wrapper; the wrapper's unit test did not run
  there).
pyproject.toml's torch range is these two versions and what lies between.

Where a public form exists it is used at the call site instead, and not wrapped:
`torch.compiler.disable` (was `torch._dynamo.disable`, strategies/parts/opaque.py),
`DTensor.to_local()` (was `_local_tensor`, strategies/parts/tensor_parallel.py: read under
`no_grad` and detached, the same memory), `Module.named_parameters(recurse=False,
remove_duplicate=False)` (was a read of `_parameters`, zero3/plan.py) and
`DefaultSavePlanner.create_global_plan` (was an override of `_create_global_plan`,
checkpoint/dcp.py). Python's own `sys._getframe` is here too: it is the interpreter's.

What stays outside on purpose: the names of torch's `_foreach_*` ops that
strategies/parts/grad_ops.py recognises in `__torch_function__` (strings naming the ops a user's
clip calls, not calls of ours), transformers' `_init_weights` (models/hf.py: not torch's).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.variable import Variable
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BatchNormBase",
    "MODULE_HOOK_DICTS",
    "TorchDispatchMode",
    "add_load_state_dict_pre_hook",
    "backend_timeout",
    "caller_frame",
    "clear_optimizer_hooks",
    "dedup_save_plans",
    "default_store",
    "fake_store",
    "flash_attention_cpu",
    "foreach_copy_",
    "foreach_lerp_",
    "in_backward",
    "incompatible_keys",
    "last_step_pre_hook",
    "local_shape_and_offset",
    "make_subclass",
    "no_subclass_dispatch",
    "object_unpickler",
    "queue_after_backward",
    "registered_children",
    "registered_parameter",
    "replace_parameters",
    "set_object_unpickler",
    "set_parameter",
    "storage_id",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "unwrapped_step",
    "validate_global_plan",
    "view_base",
]

# torch.utils._pytree: no public module in 2.13 (torch.utils.pytree does not exist there).
# Checked: 2.13, 2.11.
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map

# The base class of every BatchNorm with running statistics (1d/2d/3d, lazy, torch's
# SyncBatchNorm), not of InstanceNorm: `nn.modules.batchnorm._BatchNorm`, no public name.
# Subclassed by our SyncBatchNorm. Checked: 2.13, 2.11.
BatchNormBase = nn.modules.batchnorm._BatchNorm

# Every per-module hook dict nn.Module keeps in its instance `__dict__`, all keyed by the hook's
# handle id (nn.Module.__init__'s attributes). Checked: 2.13, 2.11.
MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


# --- the interpreter -------------------------------------------------------------------------


def caller_frame(depth: int = 1):
    """The frame `depth` calls above the caller of this function (`sys._getframe(depth)` as the
    caller would have written it). Python's, not torch's: CPython-specific, no public form
    that does not build the whole stack (`inspect.stack` reads every frame's source). Checked:
    CPython 3.10-3.13 with torch 2.13 and 2.11."""
    return sys._getframe(depth + 1)


# --- tensors and storages ----------------------------------------------------------------------


def storage_id(storage: torch.UntypedStorage) -> int:
    """A key that tells a storage apart from every other live one, meta storages included
    (`UntypedStorage._cdata`, the C++ object's address; `data_ptr()` is 0 for every meta
    storage). Checked: 2.13, 2.11."""
    return storage._cdata


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of, or None (`Tensor._base`; no public accessor).
    Checked: 2.13, 2.11."""
    return tensor._base


def make_subclass(cls: type, base: torch.Tensor) -> torch.Tensor:
    """A `cls` instance over `base`'s memory, detached, `requires_grad=False`
    (`Tensor._make_subclass`, what `nn.Parameter` uses). The public `as_subclass` differs: it
    keeps `base`'s autograd history. Checked: 2.13, 2.11."""
    return torch.Tensor._make_subclass(cls, base)


def no_subclass_dispatch():
    """A context in which a Tensor subclass's `__torch_function__` is not called (operations
    run as on a plain tensor): `torch._C.DisableTorchFunctionSubclass`, what
    `Tensor.__torch_function__` itself enters. Checked: 2.13, 2.11."""
    return torch._C.DisableTorchFunctionSubclass()


def foreach_lerp_(targets: list, sources: list, weight: float) -> None:
    """`targets[i].lerp_(sources[i], weight)` for all i in one kernel (`torch._foreach_lerp_`,
    the fused kernel torch's optimizers use; documented but underscored). Checked: 2.13, 2.11."""
    torch._foreach_lerp_(targets, sources, weight)


def foreach_copy_(targets: list, sources: list) -> None:
    """`targets[i].copy_(sources[i])` for all i in one kernel (`torch._foreach_copy_`).
    Checked: 2.13, 2.11."""
    torch._foreach_copy_(targets, sources)


def flash_attention_cpu():
    """The CPU flash-attention op, which keeps no s x s scores for backward
    (`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, causal)`,
    output first). Checked: 2.13, 2.11."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


# --- autograd ------------------------------------------------------------------------------------


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread
    (`torch._C._current_graph_task_id() != -1`, FSDP2's `is_bw()`). Checked: 2.13, 2.11."""
    return torch._C._current_graph_task_id() != -1


def queue_after_backward(callback) -> None:
    """Run `callback` when the current backward finishes
    (`Variable._execution_engine.queue_callback`, what DDP and FSDP use; only valid inside a
    backward). Checked: 2.13, 2.11."""
    Variable._execution_engine.queue_callback(callback)


# --- nn.Module -------------------------------------------------------------------------------------


def registered_children(module: nn.Module) -> list[tuple[str, nn.Module | None]]:
    """(name, child) of every child registered on `module`, None entries and a child
    registered under two names included (`Module._modules`; `named_children()` drops both).
    Checked: 2.13, 2.11."""
    return list(module._modules.items())


def registered_parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter registered on `module` as `name`, even where an instance attribute of
    that name now shadows it (`Module._parameters[name]`; `getattr` and `get_parameter` return
    the shadow). Checked: 2.13, 2.11."""
    return module._parameters[name]


def set_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """Register `param` as `module`'s `name` in place of what is there, with no check and no
    registration hook (`Module._parameters[name] = param`; `register_parameter` refuses a name
    an instance attribute holds, `setattr` goes through a subclass's `__setattr__`).
    Checked: 2.13, 2.11."""
    module._parameters[name] = param


def replace_parameters(module: nn.Module, make) -> None:
    """Give `module` its own parameter dict, `make(name, param)` for each registered entry
    (None entries kept as None): what a shallow copy of a module needs so that its parameters
    are not its original's (`Module._parameters`). Checked: 2.13, 2.11."""
    module._parameters = {
        name: None if param is None else make(name, param)
        for name, param in module._parameters.items()
    }


def add_load_state_dict_pre_hook(module: nn.Module, hook) -> None:
    """Call `hook(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)`
    before `module` loads its part of a state dict (`Module._register_load_state_dict_pre_hook`,
    without the module). The public `register_load_state_dict_pre_hook` keeps the module inside
    the hook (`_WrappedHook`), so `copy.deepcopy` of the hook dicts (strategies/model_copy.py)
    reached the model and its strategy: "cannot pickle 'ProcessGroup'" (tests/dist/test_ema.py).
    Checked: 2.13, 2.11."""
    module._register_load_state_dict_pre_hook(hook)


def incompatible_keys(missing: list[str], unexpected: list[str]):
    """What `Module.load_state_dict` returns (`torch.nn.modules.module._IncompatibleKeys`, a
    named tuple with torch's own repr). Checked: 2.13, 2.11."""
    return _IncompatibleKeys(missing, unexpected)


# --- torch.optim -------------------------------------------------------------------------------------


def last_step_pre_hook(optimizer: torch.optim.Optimizer) -> int | None:
    """The handle id of the step pre-hook registered last on `optimizer` (runs last), or None
    (`Optimizer._optimizer_step_pre_hooks`, an OrderedDict by handle id; the public
    `register_step_pre_hook` gives handles but no way to list them). Checked: 2.13, 2.11."""
    hooks = optimizer._optimizer_step_pre_hooks
    return next(reversed(hooks)) if hooks else None


def clear_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give `optimizer` (an instance whose `__dict__` was copied from another) empty hook dicts
    of its own: every instance attribute `_optimizer_*` that is an OrderedDict (step pre/post,
    state-dict and load-state-dict hooks). Checked: 2.13, 2.11."""
    for name, value in list(vars(optimizer).items()):
        if name.startswith("_optimizer_") and isinstance(value, OrderedDict):
            setattr(optimizer, name, OrderedDict())


def unwrapped_step(cls: type):
    """`cls.step` without the wrapper torch's Optimizer puts around it (profiling and the step
    hooks, `functools.wraps`' `__wrapped__`): the class's update alone. Checked: 2.13, 2.11."""
    step = cls.step
    return getattr(step, "__wrapped__", step)


# --- torch.distributed ---------------------------------------------------------------------------


def backend_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta | None:
    """The collective timeout `group`'s backend for `device` was made with; None where it has
    no backend for that device or no options to read (the fake backend)
    (`ProcessGroup._get_backend(device).options._timeout`). Checked: 2.13 (gloo), 2.11 (NCCL)."""
    try:
        backend = group._get_backend(device)
    except (RuntimeError, ValueError):  # no backend for this device type
        return None
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def default_store() -> dist.Store:
    """The store the default process group was made on
    (`distributed_c10d._get_default_store`). Checked: 2.13, 2.11."""
    return dist.distributed_c10d._get_default_store()


def fake_store() -> dist.Store:
    """A store for torch's "fake" backend, whose collectives return at once; importing it
    registers the backend (`torch.testing._internal.distributed.fake_pg.FakeStore`).
    Checked: 2.13, 2.11."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def object_unpickler():
    """The class torch's `*_object` collectives unpickle with (`distributed_c10d._unpickler`).
    Checked: 2.13, 2.11."""
    return dist.distributed_c10d._unpickler


def set_object_unpickler(unpickler) -> None:
    """Make `unpickler` the class torch's `*_object` collectives unpickle with, process-wide
    (`distributed_c10d._unpickler`). Checked: 2.13, 2.11."""
    dist.distributed_c10d._unpickler = unpickler


def local_shape_and_offset(shape, mesh, placements) -> tuple[tuple, tuple]:
    """This rank's local shape and global offset of a DTensor of `shape` on `mesh` with
    `placements` (`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`).
    Checked: 2.13, 2.11."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, list(placements))
    return tuple(local), tuple(offset)


def dedup_save_plans(planner, all_plans: list) -> list:
    """DCP's removal of the items several ranks write, as `planner` (a DefaultSavePlanner) is
    set to do it (`DefaultSavePlanner._dedup_save_plans`). Checked: 2.13, 2.11."""
    return planner._dedup_save_plans(all_plans)


def validate_global_plan(global_plan: list, metadata, keys: list[str]) -> list[str]:
    """DCP's check that each tensor's boxes cover it once
    (`default_planner._validate_global_plan`): its errors, empty where it passed. 2.13 returns
    the errors; 2.11 only True/False, so a failure there is one line per key of `keys` (those
    the caller asked it to vouch for). Checked: 2.13, 2.11 (a unit test stands in for 2.11's
    answer)."""
    from torch.distributed.checkpoint import default_planner

    errors = default_planner._validate_global_plan(global_plan, metadata)
    if isinstance(errors, bool):
        if errors:
            return []
        return [f"key:{name} has overlapping chunks or leaves part uncovered" for name in keys]
    return list(errors)

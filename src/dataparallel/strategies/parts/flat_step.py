"""The flat step: an elementwise optimizer steps each run of contiguous parameters as one tensor.

[Note: flat step] torch's optimizers loop over their parameters: AdamW's default (for-loop)
implementation runs about ten tensor operations per parameter from Python. On a model of many
small tensors that loop is a large part of a step (gpt-deep-narrow, 388 tensors of 1.2M
elements on one CPU core: 8.8 ms per parameter, 2.0 ms over one flat tensor). An elementwise
optimizer ([Note: optimizer layout] in optimizer_layout.py) updates an element from that element's
gradient and state and per-parameter scalars alone, so where a param group's parameters lie end
to end in one buffer and their gradients end to end, in the same order, in another (every
bucket of DDP, every flat shard of ZeRO-1/2/3: the engine lays them so), one step of the same
class over the run's flat tensor is that update, for every parameter of the run at once.

`FlatStep` does it behind the user's optimizer, which stays what it was (its class, its param
groups, per-parameter state, `state_dict`, schedulers, GradScaler):
- The runs (`Run`) are found from the memory itself: parameters of one group, one storage,
  each starting where the previous ends (in memory order, whatever the group's order), of one
  dtype, at least two. Before each step
  every run checks that its parameters are still where they were (a re-laid bucket moves
  them: the runs are found again) and that every gradient is there, a contiguous view of one
  buffer in the same order. A run that passes is stepped flat by a shadow optimizer of the
  same class (one per user optimizer, the user's hyper-parameters copied into it before each
  step, so a scheduler's learning rate applies), over a tensor that views the run's memory,
  with a gradient that views the gradients' memory: nothing is copied.
- The state: the run's state is the shadow's flat state, and each parameter's state in the
  user's optimizer views its part of it (elementwise entries) or is the same object (the
  per-parameter scalars, such as Adam's `step`, equal over the run by construction). Saving,
  the plain per-parameter form, and the geometry read it as before; its bytes are the same.
  State that exists before the first flat step (a loaded checkpoint, Adagrad's initial sum)
  is adopted: laid end to end into the flat state once, when the run's scalars agree.
  `load_state_dict` replaces the state, so the runs adopt it again at the next step.
- What is not stepped flat is stepped by the user's optimizer itself, exactly as without
  this: parameters outside every run, runs with a gradient missing (a parameter no rank used
  has `.grad` None and must be skipped: no decay, no `step` count, [Note: skipped parameters]
  in flat_shard.py) or not laid in order (a user replaced a `.grad`), runs whose parameters'
  state disagrees (a parameter skipped once keeps its own `step` from then on: its run gives
  each parameter its own copy of the scalars and stays per parameter). The step's
  pre-hook hands the flat runs to the shadow and takes them out of the param groups for the
  class's own step; the groups are put back right after it (post-hook, and on any exception).
- A fused optimizer (`fused=True`) steps each run through the same fused kernel, one call over
  the run's tensor ([Note: the fused flat step]). Off: a step with a closure (it recomputes
  the gradients inside the step), differentiable or capturable optimizers, a step pre-hook
  registered after this one (it must see the gradients before the update), and any class
  whose shadow cannot be built the way its instance was; those steps run as the class's own.

The elementwise update is the same arithmetic; over a longer tensor the vectorised kernels may
take another path for some elements (a fused multiply-add against a multiply then an add),
so a flat step can differ from the per-parameter one in the last bit of some elements.

[Note: the fused flat step] torch's for-loop makes about ten passes over memory per update,
`fused=True` one (`torch._fused_adamw_`): over one flat fp32 tensor on one CPU thread, AdamW
takes 5.9 ms for-loop, 4.4 foreach, 1.0 fused at 1.2M elements (`python
benchmarks/bench_flat_kernel.py`). The kernel stays the one the user built: torch's default
(the for-loop on CPU, foreach on CUDA) is what a plain loop in one process runs, and the fused
kernel differs from it in the last bit of some elements, which Muon's orthogonalisation grows
to 1e-3 in four steps (tests/dist/test_user_lines.py's Muon + AdamW). `dataparallel train` builds AdamW fused where that was measured fastest
([Note: the job's AdamW kernel] in train/optimizers.py). GradScaler sets `grad_scale` and
`found_inf` on a fused optimizer for its step; the shadow is handed both, so the fused kernel
unscales the flat runs and skips them on an overflow as it does the others.
"""

from __future__ import annotations

from collections import defaultdict
from types import MethodType

import torch

from ...torch_internals import clear_optimizer_hooks, last_step_pre_hook, unwrapped_step, view_base
from .geometry import SCALAR_STATE_KEYS
from .torch_calls import CALLS, calls_of

OFF_OPTIONS = ("differentiable", "capturable")
# What torch.amp.GradScaler sets on an optimizer whose class unscales inside its step (the
# fused classes, `_step_supports_amp_scaling`), for that step only.
AMP_ATTRIBUTES = ("grad_scale", "found_inf")


class Run:
    """Parameters of one param group lying end to end in one storage (at least two).

    group: the index of the user's param group.
    params: the parameters, in memory order.
    flat: a tensor viewing their memory as one 1-D tensor (the shadow steps it).
    """

    def __init__(self, group: int, params: list[torch.Tensor]):
        self.group = group
        self.params = params
        first = params[0]
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (self.numel,)
        )
        self.ptrs = [p.data_ptr() for p in params]  # where the parameters were found
        # byte offset of each parameter's gradient from the first one's, when laid in order
        self.steps = [ptr - self.ptrs[0] for ptr in self.ptrs]
        self.adopted = False  # whether the parameters' state views the shadow's flat state

    def in_place(self) -> bool:
        return [p.data_ptr() for p in self.params] == self.ptrs

    def flat_grad(self) -> torch.Tensor | None:
        """The gradients as one 1-D tensor viewing their memory, or None when one is missing
        or they are not one buffer's contiguous views in the parameters' order."""
        first = self.params[0].grad
        if first is None:
            return None
        base = view_base(first)
        if base is None or not base.is_contiguous():
            return None
        start = first.data_ptr()
        for param, step in zip(self.params, self.steps, strict=True):
            grad = param.grad
            if (
                grad is None
                or view_base(grad) is not base
                or grad.data_ptr() - start != step
                or not grad.is_contiguous()
            ):
                return None
        offset = first.storage_offset() - base.storage_offset()
        return base.view(-1)[offset : offset + self.numel]


def find_runs(optimizer: torch.optim.Optimizer) -> list[Run]:
    """The runs of [Note: flat step] among `optimizer`'s plain, dense, contiguous parameters."""
    runs = []
    for index, group in enumerate(optimizer.param_groups):
        current: list[torch.Tensor] = []
        end = None
        plain = [
            p
            for p in group["params"]
            if type(p) in (torch.Tensor, torch.nn.Parameter)
            and p.layout == torch.strided
            and p.device.type != "meta"  # no addresses to find runs by (a dry run)
            and p.is_contiguous()
            and p.numel() > 0
        ]
        # In memory order: DDP lays its buckets in reverse registration order.
        plain.sort(key=lambda p: (p.untyped_storage().data_ptr(), p.data_ptr()))
        for param in plain:
            here = (param.untyped_storage().data_ptr(), param.dtype, param.data_ptr())
            if current and end == here:
                current.append(param)
            else:
                runs.extend(_close(index, current))
                current = [param]
            end = (here[0], param.dtype, param.data_ptr() + param.numel() * param.element_size())
        runs.extend(_close(index, current))
    return runs


def _close(group: int, params: list[torch.Tensor]) -> list[Run]:
    return [Run(group, params)] if len(params) >= 2 else []


class FlatStep:
    """[Note: flat step] for one optimizer; `install` attaches it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.shadow: torch.optim.Optimizer | None = None
        self.runs: list[Run] | None = None  # found at the first step, again when moved
        self.saved_groups: list[list] | None = None  # the groups' params while taken out
        self.broken = False  # the shadow could not be built: every step is the class's
        self.flat_steps = 0  # steps that stepped at least one run flat (tests, diagnostics)
        self.pre = optimizer.register_step_pre_hook(self._before)
        self.post = optimizer.register_step_post_hook(self._after)
        optimizer.register_load_state_dict_post_hook(self._loaded)
        optimizer.register_state_dict_post_hook(_unshared)

    # -- the step ---------------------------------------------------------------------------
    def _before(self, optimizer, args, kwargs) -> None:
        self._restore()
        if self.broken or not self._applies(args, kwargs):
            return
        if self.runs is None or not all(run.in_place() for run in self.runs):
            self._forget_runs()
            self.runs = find_runs(optimizer)
        flat = []  # (run, its flat gradient)
        for run in self.runs:
            grad = run.flat_grad()
            if grad is None:
                self._release(run)  # stepped per parameter now
            elif run.adopted or self._adopt(run):
                flat.append((run, grad))
        if not flat:
            return
        if self.shadow is None and not self._build_shadow():
            return
        self._step_shadow(flat)
        self.flat_steps += 1
        taken = {id(p) for run, _ in flat for p in run.params}
        self.saved_groups = [group["params"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in taken]

    def _after(self, optimizer, args, kwargs) -> None:
        self._restore()

    def _restore(self) -> None:
        if self.saved_groups is not None:
            for group, params in zip(self.optimizer.param_groups, self.saved_groups, strict=True):
                group["params"] = params
            self.saved_groups = None

    def _applies(self, args, kwargs) -> bool:
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            return False
        if any(
            group.get(option) for group in self.optimizer.param_groups for option in OFF_OPTIONS
        ):
            return False
        return last_step_pre_hook(self.optimizer) == self.pre.id

    def _build_shadow(self) -> bool:
        """A copy of the user's optimizer with no parameters, no state and no hooks: same
        class, same attributes. False (and never again) when the class cannot be copied.
        Every instance attribute is kept: `copy.copy` goes through torch's `__getstate__`,
        which keeps only `defaults`, `state` and `param_groups`, and a class that reads its
        own (pytorch_optimizer's Lion, `self.maximize`) failed in its first flat step."""
        try:
            shadow = type(self.optimizer).__new__(type(self.optimizer))
            shadow.__dict__.update(vars(self.optimizer))
        except Exception:
            self.broken = True
            return False
        calls = calls_of(self.optimizer)  # [Note: torch's own calls]: the instance's, not a copy's
        for name in ("step", "_dataparallel_flat_step", *(calls.names if calls else ())):
            shadow.__dict__.pop(name, None)
        shadow.__dict__.pop(CALLS, None)
        shadow.state = defaultdict(dict)
        shadow.param_groups = []
        clear_optimizer_hooks(shadow)
        self.shadow = shadow
        return True

    def _step_shadow(self, flat: list[tuple[Run, torch.Tensor]]) -> None:
        shadow = self.shadow
        groups: dict[int, dict] = {}
        for run, grad in flat:
            run.flat.grad = grad
            if run.group not in groups:
                hyper = {k: v for k, v in self.optimizer.param_groups[run.group].items()}
                groups[run.group] = {**hyper, "params": []}
            groups[run.group]["params"].append(run.flat)
        shadow.param_groups = list(groups.values())
        for name in AMP_ATTRIBUTES:  # [Note: the fused flat step]
            if hasattr(self.optimizer, name):
                setattr(shadow, name, getattr(self.optimizer, name))
            else:
                shadow.__dict__.pop(name, None)
        step = unwrapped_step(type(shadow))  # the class's update, not its hooks again
        try:
            with torch.no_grad():
                step(shadow)
        finally:
            shadow.param_groups = []
            for run, _ in flat:
                run.flat.grad = None  # the gradient's memory is not held past the step
        for run, _ in flat:
            if not run.adopted:
                self._link(run)

    # -- the state --------------------------------------------------------------------------
    def _adopt(self, run: Run) -> bool:
        """Make the run's state the shadow's flat state: nothing to do when no parameter has
        any yet (the shadow's step creates it); otherwise laid end to end, when every parameter
        has the same entries and the same scalars. False: step it per parameter."""
        state = self.optimizer.state
        present = [p in state and bool(state[p]) for p in run.params]
        if not any(present):
            return True  # the shadow creates the flat state; `_link` shares it after the step
        if not all(present):
            return False
        states = [state[p] for p in run.params]
        keys = set(states[0])
        flat_state = {}
        for key in keys:
            values = [s.get(key) for s in states]
            if any(key not in s for s in states):
                return False
            first = values[0]
            if _elementwise(key, first, run.params[0]):
                if not all(
                    _elementwise(key, v, p) for v, p in zip(values, run.params, strict=True)
                ):
                    return False
                flat_state[key] = torch.cat([v.reshape(-1) for v in values])
            elif not all(_same(first, v) for v in values[1:]):
                return False
            else:
                flat_state[key] = first.clone() if torch.is_tensor(first) else first
        if self.shadow is None and not self._build_shadow():
            return False
        self.shadow.state[run.flat] = flat_state
        self._link(run)
        return True

    def _link(self, run: Run) -> None:
        """Each parameter's state: views of the flat state, the scalars shared."""
        flat_state = self.shadow.state[run.flat]
        offset = 0
        for param in run.params:
            numel = param.numel()
            mine = {}
            for key, value in flat_state.items():
                if _elementwise(key, value, run.flat):
                    mine[key] = value[offset : offset + numel].view_as(param)
                else:
                    mine[key] = value
            self.optimizer.state[param] = mine
            offset += numel
        run.adopted = True

    def _release(self, run: Run) -> None:
        """The run goes per parameter: each gets its own copy of the shared scalars (its
        elementwise entries stay views of memory nobody else steps)."""
        if not run.adopted:
            return
        for param in run.params:
            mine = self.optimizer.state[param]
            for key, value in mine.items():
                if torch.is_tensor(value) and not _elementwise(key, value, param):
                    mine[key] = value.clone()
        if self.shadow is not None:
            self.shadow.state.pop(run.flat, None)
        run.adopted = False

    def _forget_runs(self) -> None:
        for run in self.runs or []:
            self._release(run)
        self.runs = None

    def _loaded(self, optimizer) -> None:
        """`load_state_dict` replaced every parameter's state: adopt it again at the next step.
        A state saved while a run was adopted holds one scalar object for the whole run (a
        copy, a `torch.save`, keeps that), and torch's load keeps `step` as it is: each
        parameter gets its own again, so that a step per parameter counts each once."""
        seen: set[int] = set()
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and not _elementwise(key, value, param):
                    if id(value) in seen:
                        state[key] = value.clone()
                    else:
                        seen.add(id(value))
        for run in self.runs or []:
            run.adopted = False
        if self.shadow is not None:
            self.shadow.state.clear()


def _unshared(optimizer, state_dict: dict) -> dict:
    """`optimizer.state_dict()` in PyTorch's plain per-parameter form: a run's parameters share
    one object for each scalar (Adam's `step`), and a copy or a `torch.save` keeps that sharing,
    so a plain optimizer that loads it (nanoGPT's resume in one process) would advance the one
    `step` once per parameter (4, 5, 6 ... where one process has 4: 3.95e-4 off after the
    resume). Each parameter gets its own copy here; the optimizer's own state is untouched."""
    seen: set[int] = set()
    for index, entry in list(state_dict["state"].items()):
        shared = [k for k, v in entry.items() if torch.is_tensor(v) and id(v) in seen]
        seen.update(id(v) for v in entry.values() if torch.is_tensor(v))
        if shared:
            state_dict["state"][index] = {
                k: (v.clone() if k in shared else v) for k, v in entry.items()
            }
    return state_dict


def _elementwise(key: str, value, like: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == like.shape and key not in SCALAR_STATE_KEYS


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return not torch.is_tensor(a) and not torch.is_tensor(b) and a == b


def _step(optimizer, *args, **kwargs):
    """The optimizer's `step` with [Note: flat step]: the class's (hooks and all), and the
    param groups whole again afterwards even when it raised."""
    try:
        return type(optimizer).step(optimizer, *args, **kwargs)
    finally:
        optimizer._dataparallel_flat_step._restore()


def install_flat_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Attach [Note: flat step] to an optimizer of an elementwise class; returns it."""
    optimizer._dataparallel_flat_step = FlatStep(optimizer)
    optimizer.step = MethodType(_step, optimizer)  # a scheduler's wrapper rebinds `_step`
    return optimizer

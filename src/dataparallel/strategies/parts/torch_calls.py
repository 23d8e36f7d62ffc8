"""PyTorch's own calls on a sharded model and its optimizer: the one-process result, or one line.

[Note: torch's own calls] Scripts carry PyTorch's lines, not ours: nanoGPT's checkpoint saves
`{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}` on rank 0 and its resume
loads both; schedule-free's `optimizer.eval()` swaps the weights before evaluation; a loss
scaler steps every rank's optimizer. Under ZeRO-1/2/3 (any strategy whose optimizer holds
shards or owned masters rather than the model's parameters) each of these met a silent wrong
result or torch's own confusing error. What each does now:
- `optimizer.state_dict()` would be this rank's shard only (a rank-0 `torch.save` of it is not
  a checkpoint, and loading it fails inside torch with a size error): refused in one line that
  names `dp.optimizer_state_dict` (collective: every rank calls it, one saves) and the run's
  checkpoints. Giving the whole state instead would need every rank, and nanoGPT calls it on
  rank 0 alone: that would hang.
- `optimizer.load_state_dict(state)` takes PyTorch's plain per-parameter form (what DDP, one
  process or `dp.optimizer_state_dict` saved): each rank keeps its part, no collective. Anything
  else (a shard saved by an older version, another model's state) is refused in one line.
- A method the optimizer's class adds to torch's (schedule-free's `eval()` and `train()`, which
  move the weights between their averaged and training points) writes the optimizer's tensors,
  which reach the model only at the next `step()`: after each call the strategy refreshes the
  model's parameters from them (`refresh_params`, a collective: every rank calls the method, as
  every rank calls `step()`). Methods called from inside `step()` or from such a method are
  passed through.
- `torch.amp.GradScaler.step` asserts on an optimizer with no gradient ("No inf checks were
  recorded"), which a rank that owns nothing has: every sharded optimizer carries one more
  one-element tensor in its last param group (`FoundInf`) whose gradient, set at the end of each
  synchronised round, is NaN when the round's found-inf agreement ([Note: found inf] in
  round.py) found one on any rank and 0 otherwise; every rank's scaler then sees the same
  verdict and steps or skips with the others. The class never steps it (its `.grad` is None
  during `step()`), the state dicts and checkpoints leave it out (`is_carrier`).
- `model.state_dict()` under ZeRO-3 would be the NaN placeholders of parameters at rest:
  refused in one line naming `dp.full_state_dict` (`keep_vars=True`, which asks for the
  parameter objects themselves, is answered: the library reads names and shapes through it).
  Under ZeRO-1/2 every rank holds the whole parameters and torch's answer is the right one.
- `model.load_state_dict(state)` of a whole state loads it as `dp.load_full_state_dict` does
  (masters and owners included; collective where owners or ZeRO-1/2's gather are), with torch's
  `strict` rules and its return value; a submodule's own `load_state_dict` is refused in one
  line (it would write around the shards).
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn

from ...torch_internals import incompatible_keys

CALLS = "_dataparallel_calls"
_CARRIER = "_dataparallel_carrier"
# torch.optim.Optimizer's own API and what the strategies wrap: never treated as a method that
# writes parameters.
TORCH_OWN = frozenset(dir(torch.optim.Optimizer))


def is_carrier(tensor) -> bool:
    """Whether `tensor` is a sharded optimizer's found-inf carrier (not a parameter's part)."""
    return getattr(tensor, _CARRIER, False)


class FoundInf:
    """The found-inf carrier of one sharded optimizer ([Note: torch's own calls])."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.tensor = torch.zeros(1, device=device)
        setattr(self.tensor, _CARRIER, True)
        self.clean = torch.zeros(1, device=device)
        self.poisoned = torch.full((1,), float("nan"), device=device)
        optimizer.param_groups[-1]["params"].append(self.tensor)

    def verdict(self, nonfinite: bool) -> None:
        """The end of a synchronised round: what every rank's scaler must see."""
        self.tensor.grad = self.poisoned if nonfinite else self.clean

    def before_step(self, *args) -> None:
        self.tensor.grad = None  # the class's step skips it, as any parameter without a grad


class OptimizerCalls:
    """torch's own calls on one sharded optimizer ([Note: torch's own calls]).

    strategy: its name, for the errors. to_local: plain state dict -> this rank's state dict
        (raises ValueError when the state is not plain). refresh: the model's parameters from
        the optimizer's tensors (collective).
    """

    def __init__(self, optimizer, strategy: str, to_local, refresh, device: torch.device):
        self.optimizer = optimizer
        self.strategy = strategy
        self.to_local = to_local
        self.refresh = refresh
        self.depth = 0  # calls of class methods in progress (nested ones pass through)
        self.stepping = False
        self.found_inf = FoundInf(optimizer, device)
        self.names = ["state_dict", "load_state_dict"]
        optimizer.state_dict = MethodType(_refused_state_dict, optimizer)
        optimizer.load_state_dict = MethodType(_plain_load_state_dict, optimizer)
        for name in written_by(type(optimizer)):
            setattr(optimizer, name, self._refreshing(getattr(optimizer, name)))
            self.names.append(name)
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)
        setattr(optimizer, CALLS, self)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.found_inf.before_step()
        self.stepping = True

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.stepping = False

    def _refreshing(self, method):
        def call(*args, **kwargs):
            if self.stepping or self.depth:
                return method(*args, **kwargs)
            self.depth += 1
            try:
                result = method(*args, **kwargs)
            finally:
                self.depth -= 1
            self.refresh()
            return result

        call.__name__ = getattr(method, "__name__", "method")
        call.__doc__ = getattr(method, "__doc__", None)
        return call


def calls_of(optimizer) -> OptimizerCalls | None:
    return getattr(optimizer, CALLS, None)


def written_by(cls: type) -> list[str]:
    """The public methods `cls` (and its bases short of torch.optim.Optimizer) adds to torch's
    optimizer API: what may write the parameters outside `step()`."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass in (torch.optim.Optimizer, object) or issubclass(torch.optim.Optimizer, klass):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in TORCH_OWN or name in names:
                continue
            if callable(value) and not isinstance(value, (staticmethod, classmethod, type)):
                names.append(name)
    return names


def _refused_state_dict(optimizer) -> dict:
    calls = calls_of(optimizer)
    raise RuntimeError(
        f"optimizer.state_dict() under {calls.strategy} would hold this rank's shard only, not "
        "a checkpoint: save dp.optimizer_state_dict(model, optimizer) (a collective: every rank "
        "calls it, one saves) or the run's sharded checkpoints (docs/zero.md)"
    )


def _plain_load_state_dict(optimizer, state_dict: dict) -> None:
    calls = calls_of(optimizer)
    try:
        local = calls.to_local(state_dict)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"optimizer.load_state_dict under {calls.strategy} takes a plain optimizer's state "
            "over the model's parameters (saved under DDP, in one process, or by "
            f"dp.optimizer_state_dict), and this one is not: {error}"
        ) from None
    load_local(optimizer, local)


def local_state_dict(optimizer) -> dict:
    """This rank's optimizer state as torch keeps it (a shard under ZeRO): to put back on the
    same rank later, never a checkpoint."""
    return type(optimizer).state_dict(optimizer)


def load_local(optimizer, state_dict: dict) -> None:
    """Load what `local_state_dict` returned (or a strategy built for this rank)."""
    type(optimizer).load_state_dict(optimizer, state_dict)


# -- the model ------------------------------------------------------------------------------
class ModelCalls:
    """torch's own state-dict calls on a sharded model ([Note: torch's own calls]).

    strategy: the model's strategy (its name, `full_state_dict`, `load_full_state_dict`,
        `placeholders_at_rest`).
    """

    def __init__(self, model: nn.Module, strategy):
        self.strategy = strategy
        model.load_state_dict = MethodType(self._load, model)
        model.zero_grad = MethodType(self._zero_grad, model)
        for module in model.modules():
            if module is model or next(module.parameters(recurse=False), None) is None:
                continue
            module.register_load_state_dict_pre_hook(self._refuse_partial_load)
        if strategy.placeholders_at_rest:
            for module in model.modules():
                module.register_state_dict_pre_hook(self._refuse_placeholders)

    def _zero_grad(self, model: nn.Module, set_to_none: bool = True) -> None:
        """`model.zero_grad()`: the module's own, and the reduced gradients held in the shards
        with it, in any place of the step ([Note: cleared after the forward] in reducer.py)."""
        type(model).zero_grad(model, set_to_none)
        self.strategy.held.clear_all(set_to_none)

    def _refuse_placeholders(self, module, prefix, keep_vars) -> None:
        if not keep_vars:
            raise RuntimeError(
                f"model.state_dict() under {self.strategy.name}: the parameters at rest are "
                "placeholders (each rank holds a shard); use dp.full_state_dict(model) (a "
                "collective: every rank calls it, one saves) or the run's checkpoints"
            )

    def _refuse_partial_load(self, module, *args) -> None:
        raise RuntimeError(
            f"load_state_dict on a submodule under {self.strategy.name} would write around the "
            "shards; load the whole model: model.load_state_dict(state) or "
            "dp.load_full_state_dict(model, state)"
        )

    def _load(self, model: nn.Module, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict` for the whole sharded model (`dp.load_full_state_dict`)."""
        if assign:
            raise ValueError(
                f"load_state_dict(assign=True) under {self.strategy.name} would replace the "
                "parameters that view the shards; load without assign"
            )
        keys = list(model.state_dict(keep_vars=True))
        known = set(keys)
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in known]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"load_state_dict: missing keys {missing[:5]}, unexpected keys "
                f"{unexpected[:5]} (strict=True)"
            )
        full = self.strategy.full_state_dict() if missing else {}
        full.update({k: v for k, v in state_dict.items() if k not in unexpected})
        self.strategy.load_full_state_dict(full)
        return incompatible_keys(missing, unexpected)

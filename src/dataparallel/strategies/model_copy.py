"""A copy of a parallelized model: `copy.deepcopy(model)`, and so `AveragedModel(model)`.

[Note: model copies] `parallelize` gives the model its own `__deepcopy__` (an instance
attribute, which `copy.deepcopy` looks up before anything else). Without it the copy would
reach the strategy (through the model's attribute and every hook it registered) and fail on
its process groups: "cannot pickle 'ProcessGroup' object". With it, under DDP and ZeRO-1/2 the
copy is a plain module, as a copy of the module inside PyTorch's DDP is:
- the parameters' current whole values (ZeRO-1/2's flat buffers are whole on every rank after
  `step()`; a parameter gather still in flight under `overlap_param_gather` is finished first),
  each in its own memory (a parameter's deepcopy clones its values, not the flat buffer), with
  no `.grad`;
- no strategy (`parallelize` may be called on it) and none of the hooks registered since
  `parallelize` began (the strategy's, its casts and gathers, or any the user registered after
  it: handles are numbered in registration order); hooks the model had before are copied as
  `copy.deepcopy` copies them (a model's own `load_state_dict` pre-hook keeps working).
Not collective: one rank may copy alone. Under ZeRO-3 a parameter at rest is a one-element
NaN placeholder ([Note: parameters at rest] in zero3/unit.py), so a copy would be a model of
NaNs, and an EMA built on it would average NaNs without a word: the copy is refused in one
line that names the sharded EMA (`dataparallel.EMA`, exact since an EMA is elementwise) and
`dataparallel.full_state_dict` for the weights.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..torch_internals import MODULE_HOOK_DICTS


def next_hook_id() -> int:
    """The id the next registered hook gets: hooks numbered from here on are ours."""
    return RemovableHandle.next_id


class PlainCopy:
    """`copy.deepcopy`'s entry for one parallelized model ([Note: model copies]).

    strategy: the model's strategy (finishes parameter gathers; `placeholders_at_rest` refuses).
    first_hook: `next_hook_id()` when `parallelize` began.
    attr: the model attribute that holds the strategy.
    """

    def __init__(self, strategy, first_hook: int, attr: str):
        self.strategy = strategy
        self.first_hook = first_hook
        self.attr = attr

    def __call__(self, memo: dict) -> nn.Module:
        strategy = self.strategy
        if strategy.placeholders_at_rest:
            raise ValueError(
                f"copy.deepcopy: under {strategy.name} a parameter at rest is a NaN placeholder, "
                "so a copy would hold no weights; for an EMA use dataparallel.EMA(model, decay), "
                "for the weights dataparallel.full_state_dict(model)"
            )
        strategy.finish_param_gather()
        model = strategy.model
        for module in model.modules():
            for name in MODULE_HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if hooks is not None and id(hooks) not in memo:
                    kept = [(k, v) for k, v in hooks.items() if k < self.first_hook]
                    memo[id(hooks)] = type(hooks)((k, copy.deepcopy(v, memo)) for k, v in kept)
        memo[id(strategy)] = None
        memo[id(self)] = None
        del model.__dict__["__deepcopy__"]  # copy the module as torch would, then come back
        try:
            result = copy.deepcopy(model, memo)
        finally:
            object.__setattr__(model, "__deepcopy__", self)
        # what the strategy set on the instance: itself, this, and torch's load routed through
        # it ([Note: torch's own calls] in parts/torch_calls.py): the copy is a plain module
        for name in (self.attr, "__deepcopy__", "load_state_dict"):
            result.__dict__.pop(name, None)
        return result

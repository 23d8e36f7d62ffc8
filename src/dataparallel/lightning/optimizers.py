"""`configure_optimizers`' optimizers, built again on what each rank holds.

[Note: Lightning's optimizers] The LightningModule's `configure_optimizers` builds plain torch
optimizers over its own parameters, and schedulers over them, as it would for any strategy.
The engine's optimizer must be built on what this rank holds (ZeRO's shards, owned whole
parameters: [Note: optimizer layout]), so each is built again by `dp.compose` (the first, with
the recipe's averager and loss scaler) or `dp.build_optimizer` (the others, manual
optimization): the same class, the same param groups with every hyper-parameter they hold
(a group naming its own class under "optimizer" makes Muon + AdamW one optimizer: [Note:
grouped optimizer]), and the constructor's other arguments from `optimizer.defaults`. Each
scheduler then points at the built optimizer, as if it had been made on it: its state (the
learning rates it set at step 0, `base_lrs`) carries over unchanged. The plain optimizer never
steps and holds no state, so nothing is lost in between.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

import dataparallel as dp


def spelled(optimizer: torch.optim.Optimizer, module: nn.Module) -> tuple[type, list, dict]:
    """(class, param groups, constructor arguments) that build `optimizer` again."""
    if optimizer.state:
        raise ValueError(
            f"configure_optimizers: the {type(optimizer).__name__} already holds state; return "
            "a freshly built optimizer (DataParallelStrategy builds it again on each rank's "
            "shards)"
        )
    owned = {id(p) for p in module.parameters()}
    groups = []
    for group in optimizer.param_groups:
        if any(id(p) not in owned for p in group["params"]):
            raise ValueError(
                f"configure_optimizers: the {type(optimizer).__name__} holds a tensor that is "
                "not a parameter of the LightningModule; build it over self.parameters()"
            )
        groups.append(dict(group))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return type(optimizer), groups, kwargs


def build_again(
    model: nn.Module, recipe: dp.Recipe, plain: list, module: nn.Module, reads
) -> tuple[dp.Composed, list[torch.optim.Optimizer]]:
    """`dp.compose` with the first optimizer, `dp.build_optimizer` with the others."""
    if len(plain) > 1 and (recipe.local_sgd or recipe.diloco):
        raise ValueError(
            f"configure_optimizers: {len(plain)} optimizers with an averager (local_sgd/diloco) "
            "are not supported; return one optimizer (param groups may name their own class)"
        )
    declared = {} if reads is None else {"reads": reads}
    cls, groups, kwargs = spelled(plain[0], module)
    composed = dp.compose(model, recipe, cls, params=groups, **declared, **kwargs)
    return composed, [composed.optimizer, *build_each(model, plain[1:], module, reads)]


def build_each(model: nn.Module, plain: list, module: nn.Module, reads) -> list:
    """`dp.build_optimizer` for each of `plain` on the parallelized `model`."""
    declared = {} if reads is None else {"reads": reads}
    built = []
    for optimizer in plain:
        cls, groups, kwargs = spelled(optimizer, module)
        built.append(dp.build_optimizer(model, cls, params=groups, **declared, **kwargs))
    return built


def point_schedulers(configs: list, plain: list, built: list) -> None:
    """Each scheduler of `configs` follows its optimizer's built form."""
    by_id = {id(p): b for p, b in zip(plain, built, strict=True)}
    for config in configs:
        _point(config.scheduler, by_id)


def _point(scheduler, by_id: dict) -> None:
    for inner in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        _point(inner, by_id)
    built = by_id.get(id(getattr(scheduler, "optimizer", None)))
    if built is None:
        return
    scheduler.optimizer = built
    _count_steps(built)


def _count_steps(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is made on: mark `step` wrapped and
    record that it was called (its "step before optimizer.step()" warning reads both)."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def counted(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True
    optimizer.step = counted

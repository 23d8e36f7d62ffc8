"""The recipe's precision as Lightning's precision plugin, with the engine's clip.

[Note: Lightning's precision] Lightning's plugin does three things on our path: the forward's
autocast, the loss scaler's calls around the optimizer step, and clipping by
`gradient_clip_val`. The first two follow the recipe (`Recipe.precision`):
- "fp32" and "bf16-params": no autocast and no scaler; bf16-params is the strategy's own
  `MixedPrecision` (bf16 parameters and wire, fp32 masters), installed by `dp.compose`;
- "bf16": autocast to bfloat16 around each step, fp32 weights (Lightning's "bf16-mixed");
- "fp16": the strategy's fp16 parameters with `dp.compose`'s `GradScaler`, through Lightning's
  `MixedPrecision` plugin (scale, unscale before the clip, step, update) without its autocast.
Clipping is the engine's (`dp.clip_grad_norm_`, `dp.clip_grad_value_` on the parallelized
model): Lightning's own clips `optimizer.param_groups`, which under ZeRO hold this rank's
shards, so its norm would be the shard's, not the model's.
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

import dataparallel as dp

# Trainer(precision=...) -> the recipe's precision, where the two mean the same thing
FROM_LIGHTNING = {"32-true": "fp32", "bf16-mixed": "bf16"}


def recipe_precision(plugin: Precision, given: str | None) -> str:
    """The recipe's precision from what Lightning built for Trainer(precision=...) and what the
    strategy was given; one of the two, once ([Note: Lightning's precision])."""
    kind = type(plugin)
    flag = getattr(plugin, "precision", None)
    known = kind is Precision or (kind is MixedPrecision and flag == "bf16-mixed")
    if not known:
        raise ValueError(
            f"DataParallelStrategy: Trainer(precision={flag!r}) ({kind.__name__}) has no "
            "counterpart here; leave Trainer's precision at its default and give "
            "DataParallelStrategy(precision=...) one of " + ", ".join(dp.PRECISIONS)
        )
    if given is None:
        return FROM_LIGHTNING[flag]
    if flag != "32-true":
        raise ValueError(
            f"DataParallelStrategy: precision is given twice (Trainer(precision={flag!r}) and "
            f"DataParallelStrategy(precision={given!r})); give it once"
        )
    return given


class _EngineClip:
    """Clipping by the engine, over the whole parallelized model."""

    module: nn.Module

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        dp.clip_grad_norm_(self.module, float(clip_val))

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        dp.clip_grad_value_(self.module, float(clip_val))


class EnginePrecision(_EngineClip, Precision):
    """fp32, bf16-params (no autocast) and bf16 (autocast) on the engine."""

    def __init__(self, module: nn.Module, autocast: torch.dtype | None, device_type: str):
        super().__init__()
        self.module, self.autocast, self.device_type = module, autocast, device_type
        self.precision = "bf16-mixed" if autocast is torch.bfloat16 else "32-true"

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """The closure (forward, backward, then the clip), then the step without it: the
        engine's sharded optimizers take no closure, which would run the step's forward and
        backward a second time. A step whose training_step returned None is skipped."""
        result = closure()
        self._after_closure(model, optimizer)
        if result is None and model.automatic_optimization:
            return None
        optimizer.step(**kwargs)
        return result

    def forward_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast)


class ScaledPrecision(_EngineClip, MixedPrecision):
    """fp16: the strategy's fp16 parameters and `dp.compose`'s loss scaler, no autocast."""

    def __init__(self, module: nn.Module, scaler: torch.amp.GradScaler, device_type: str):
        super().__init__("16-mixed", device_type, scaler=scaler)
        self.module = module

    def forward_context(self):
        return contextlib.nullcontext()


def precision_plugin(recipe: dp.Recipe, module: nn.Module, scaler, device_type: str) -> Precision:
    """The plugin for `recipe`'s precision ([Note: Lightning's precision])."""
    if scaler is not None:
        return ScaledPrecision(module, scaler, device_type)
    return EnginePrecision(module, recipe.autocast_dtype, device_type)

"""Activation checkpointing: recompute each block's activations in backward instead of keeping
them from forward (`dataparallel train --activation-checkpointing`).

    model = dp.checkpoint_activations(model)   # before or after dp.parallelize, any strategy
    model = dp.parallelize(model, "zero3")

[Note: checkpoint inside the unit] A block's forward is replaced, on the instance, by
`torch.utils.checkpoint.checkpoint(original_forward, ..., use_reentrant=False)`: forward keeps
only the block's inputs, and backward runs the block's forward again just before its own
backward. The *forward*, not the module's `__call__`, is what is recomputed, so module hooks
stay outside the checkpoint and run once per step: ZeRO-3's unit hooks (a block is a unit by
default: both select every child of an `nn.ModuleList`) gather the block for its backward
before autograd reaches it, and the recompute reads the gathered parameters. The same order
FSDP2 asks for (its hooks outside `checkpoint_wrapper`), and the one transformers 5 takes in
`GradientCheckpointingLayer` (it checkpoints `forward`). Checkpointing the module's `__call__`
instead, `checkpoint(block, x)`, runs the unit's hooks a second time inside backward; see
docs/zero3.md ("Activation checkpointing") for what ZeRO-3 does with that.

A Hugging Face model (or a peft model around one) uses its own switch,
`activation_checkpointing_enable` (named `gradient_checkpointing_enable` before transformers
5), with `use_reentrant=False`: each decoder layer recomputed. The reentrant form is not used:
it loses the gradients of parameters when no input of the block requires a gradient (LoRA's
frozen embeddings) and ignores `torch.autograd.grad`'s inputs.

State dicts are unchanged (no wrapper module, no key prefix), so checkpoints, exports and
`dp.full_state_dict` read the same with and without it.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from .strategies import Wrap, select_units

_MARK = "_dataparallel_checkpointed"


def checkpoint_activations(model: nn.Module, blocks: Wrap = None) -> nn.Module:
    """Recompute the activations of `model`'s blocks in backward, in place; return `model`.

    blocks: which modules to recompute, as `dp.ZeRO3(wrap=...)` selects units: None is a
        Hugging Face model's own decoder layers when `model` is one (transformers' switch), else
        every child of an `nn.ModuleList` (each `Block` of the reference GPT); or a tuple of
        module classes; or a callable `module -> bool`.

    Raises ValueError when nothing is selected (a model with no `nn.ModuleList`): name the
    blocks with `blocks=`. A block already checkpointed is left as it is, so a second call
    changes nothing.
    """
    check_checkpointable(model, blocks)
    if blocks is None and _hugging_face(model) is not None:
        _enable_hugging_face(_hugging_face(model))
        return model
    for module in select_units(model, blocks):
        if not getattr(module, _MARK, False):
            module.forward = functools.partial(_recomputed, module.forward)
            setattr(module, _MARK, True)
    return model


def check_checkpointable(model: nn.Module, blocks: Wrap = None) -> None:
    """The ValueError `checkpoint_activations(model, blocks)` would raise, changing nothing
    (`dp.check_recipe` asks it for `Recipe.activation_checkpointing`)."""
    hf = _hugging_face(model) if blocks is None else None
    if hf is not None and not hf.supports_gradient_checkpointing:
        raise ValueError(
            f"checkpoint_activations: {type(hf).__name__} does not support transformers' "
            "activation checkpointing; pass blocks= with its layer class to recompute them"
        )
    if hf is None and not select_units(model, blocks):
        raise ValueError(
            f"checkpoint_activations: blocks selected no module of {type(model).__name__} "
            "(it has no nn.ModuleList); pass blocks=(YourBlock,) or a callable"
        )


def is_checkpointed(model: nn.Module) -> bool:
    """Whether `checkpoint_activations` (or transformers' switch) recomputes a block of it."""
    hf = _hugging_face(model)
    if hf is not None and getattr(hf, "is_gradient_checkpointing", False):
        return True
    return any(getattr(m, _MARK, False) for m in model.modules())


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _hugging_face(model: nn.Module):
    """The transformers model of `model` (under a peft wrapper too), or None."""
    get = getattr(model, "get_base_model", None)
    base = get() if callable(get) else model
    return base if hasattr(base, "supports_gradient_checkpointing") else None


def _enable_hugging_face(model) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

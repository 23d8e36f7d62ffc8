"""`dataparallel.plan(...)`: the planner's Python entry point."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from ..averaging.streaming import RECIPE
from ..recipe import Recipe
from .errors import PlanError
from .hardware import HardwareProfile
from .inputs import (
    DILOCO_STEPS,
    STRATEGIES,
    PlanInputs,
    optimizer_bytes,
    parse_compress,
    plan_recipe,
)
from .lora import check_root_unit, parse_lora
from .model import ModelShape, bare_shape, builtin_shape, saved_bytes, shape_of_module
from .planner import Plan, make_plan
from .profiles import get_profile
from .whole_parameters import WHOLE_PARAMETER_OPTIMIZERS, whole_parameters


def plan(
    model: str | nn.Module | None = None,
    *,
    params: float | None = None,
    layers: int = 0,
    width: int = 0,
    seq_len: int | None = None,
    vocab: int = 0,
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
    ranks: int | None = None,
    nodes: int | None = None,
    ranks_per_node: int | None = None,
    hardware="h100-node",
    precision: str = "fp32",
    optimizer: str | float = "adamw",
    micro_batch: int = 1,
    accumulation: int = 1,
    strategies: Sequence[str] = STRATEGIES,
    shard_sizes: Sequence[int] | None = None,
    compress: str = "none",
    compress_arg: float = 0.0,
    diloco_steps: int = DILOCO_STEPS,
    fragments: int = RECIPE,
    overlap: int = RECIPE,
    outer_compress: str = "recipe",
    activation_checkpointing: bool = False,
    layout: str = "dataparallel",
    bucket_mb: float | None = None,
    tp: int = 1,
    recipe: Recipe | None = None,
    lora: str = "",
) -> Plan:
    """Predict memory per rank, bytes sent and step time of every strategy, and pick one.

    model: a built-in name (`dataparallel.models`' GPTs, llama-1b/8b/70b), an nn.Module (build
        it under `torch.device("meta")`: nothing is allocated), or None with `params`.
    params: a bare parameter count; `layers`, `width`, `seq_len` (and `vocab`) add activations.
    loss_fn: for an nn.Module on the meta device, `loss_fn(model)` runs one sample's forward
        and loss on meta inputs, so its activations are counted; None counts none.
    ranks, or nodes x ranks_per_node: the world (ranks_per_node also overrides the profile's).
    hardware: a built-in profile name, a JSON file, a dict or a HardwareProfile.
    optimizer: adam, adamw, sgd, bytes of state per parameter, or muon / adafactor: the job's
        recipes, whole parameters owned per shard group (whole_parameters.py: the busiest
        owner's memory, Muon's compute; `Plan.whole`).
    lora: a LoRA fine-tune of a built-in model, `dataparallel train --lora`'s spec
        ("r=16,targets=q_proj,v_proj"): the base frozen, the adapters trained ([Note: planner
        LoRA] in lora.py). An nn.Module with its adapters applied is planned as it is.
    recipe: a `dp.Recipe` instead of precision, tp, activation_checkpointing, compress and
        DiLoCo's diloco_steps (its `diloco`), fragments, overlap and outer_compress: what the
        job or a script would compose.
    Others: see PlanInputs (inputs.py). Bad input raises PlanError naming the field.
    """
    ranks, hw = _world(ranks, nodes, ranks_per_node, hardware)
    if recipe is None:
        recipe = plan_recipe(
            precision=precision,
            tp=tp,
            activation_checkpointing=activation_checkpointing,
            diloco=checked_steps(diloco_steps),
            fragments=fragments,
            overlap=overlap,
            outer_compress=outer_compress,
        )
    elif recipe.compress:  # the DiLoCo candidates' recipe holds none ([Note: planner memory])
        compress, recipe = recipe.compress, replace(recipe, compress="")
    if ":" in compress:  # a --compress spec ("topk:ratio=0.01"), as `dataparallel train` takes
        compress, compress_arg = parse_compress(compress)
    whole = str(optimizer) in WHOLE_PARAMETER_OPTIMIZERS
    inputs = PlanInputs(
        ranks=ranks,
        recipe=recipe,
        optimizer_bytes=optimizer_bytes("adamw" if whole else str(optimizer)),
        micro_batch=micro_batch,
        accumulation=accumulation,
        strategies=tuple(strategies),
        shard_sizes=tuple(shard_sizes) if shard_sizes else None,
        compress=compress,
        compress_arg=compress_arg,
        layout=layout,
        bucket_mb=bucket_mb,
        inner="muon" if optimizer == "muon" else "adamw",
    )
    spec = parse_lora(lora, built_in=isinstance(model, str), tp=inputs.tp, layout=inputs.layout)
    shape = model_shape(model, params, layers, width, seq_len, vocab, loss_fn, inputs, spec)
    if spec is not None:
        check_root_unit(shape, inputs.strategies)
    return _whole_plan(str(optimizer), shape, hw, inputs) if whole else make_plan(shape, hw, inputs)


def _world(ranks, nodes, ranks_per_node, hardware) -> tuple[int, HardwareProfile]:
    """The world's ranks (given, or nodes x ranks per node) and the hardware profile, its
    ranks per node overridden when given."""
    if ranks is None:
        if nodes is None:
            raise PlanError(
                "--ranks", "no world given", "give --ranks N or --nodes and --ranks-per-node"
            )
        ranks = nodes * (ranks_per_node or get_profile(hardware).ranks_per_node)
    if nodes is not None and ranks_per_node and ranks != nodes * ranks_per_node:
        raise PlanError(
            "--ranks",
            f"{ranks} is not --nodes x --ranks-per-node",
            "give --ranks or the two others",
        )
    hw = get_profile(hardware)
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or ranks_per_node < 1:
            raise PlanError("--ranks-per-node", f"{ranks_per_node}", "give a positive integer")
        hw = replace(hw, ranks_per_node=ranks_per_node)
    return ranks, hw


def _whole_plan(optimizer: str, shape, hw: HardwareProfile, inputs: PlanInputs) -> Plan:
    """The plan of an optimizer of whole parameters (Muon, Adafactor): the busiest owner's
    state and compute ([Note: whole parameters] in whole_parameters.py), in `Plan.whole`."""
    data_size = inputs.parallel_layout().data_size  # [Note: layout]
    tokens = inputs.micro_batch * inputs.accumulation * data_size * shape.seq_len
    parts = whole_parameters(
        optimizer, shape, masters=inputs.masters, tokens_per_step=tokens, ranks=data_size
    )
    inputs = replace(inputs, optimizer_bytes=parts.state_bytes_per_param)
    return replace(make_plan(shape, hw, inputs), whole=parts)


def model_shape(model, params, layers, width, seq_len, vocab, loss_fn, x: PlanInputs, lora=None):
    compute = x.compute
    autocast = torch.bfloat16 if x.autocast else None
    if isinstance(model, str):
        return builtin_shape(model, seq_len, compute, autocast, x.tp, lora)
    if x.tp > 1:
        raise PlanError("--tp", "the tensor-parallel split is known for built-in models only",
                        "give --model gpt-small, llama-8b, ..., or drop --tp")  # fmt: skip
    if isinstance(model, nn.Module):
        kept = 0.0
        if loss_fn is not None:
            if any(p.device.type != "meta" for p in model.parameters()):
                raise PlanError("model", "loss_fn needs a model on the meta device",
                                'build it under torch.device("meta")')  # fmt: skip
            kept = saved_bytes(model, loss_fn)
        return shape_of_module(model, name=type(model).__name__, seq_len=seq_len or 1,
                               layers=layers, width=width, vocab=vocab,
                               activation_bytes=kept)  # fmt: skip
    if model is not None:
        raise PlanError("model", f"{model!r} is not a name or an nn.Module",
                        "give a built-in name, an nn.Module or --params")  # fmt: skip
    if params is None or not params > 0:
        raise PlanError("--params", f"{params!r}", "give --model NAME or a positive --params")
    for name, value in (("--layers", layers), ("--width", width), ("--vocab", vocab)):
        if value < 0:
            raise PlanError(name, f"{value} is negative", "give a count >= 0")
    if seq_len is not None and seq_len < 1:
        raise PlanError("--seq-len", f"{seq_len}", "give tokens per sample >= 1")
    return bare_shape(params, layers, width, seq_len or 1, vocab, compute.itemsize)


__all__ = ["ModelShape", "Plan", "plan"]


def checked_steps(diloco_steps) -> int:
    """--diloco-steps: a recipe's `diloco` H, at least 1 here (0 would turn DiLoCo off)."""
    if isinstance(diloco_steps, bool) or not isinstance(diloco_steps, int) or diloco_steps < 1:
        given = f"must be a positive integer, got {diloco_steps!r}"
        raise PlanError("--diloco-steps", given, "give inner steps per outer step, >= 1")
    return diloco_steps

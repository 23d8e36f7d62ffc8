"""`dataparallel train --tp T`: the ("dp", "tp") mesh, the checks of --tp, and which ranks read
which data.

[Note: the job's mesh] A world of N ranks is a DeviceMesh of dp = N / T rows and tp = T columns,
rank r at (r // T, r % T): tensor-parallel peers are consecutive ranks, so on several hosts the
activation all-reduces (two per block and direction) stay inside a host. The job builds it and
gives it to `dp.compose` with `Recipe.tp` = T, which splits the reference GPT over mesh["tp"]
first (PyTorch's `parallelize_module` with `GPT.tensor_parallel_plan`), then runs the strategy
over mesh["dp"] only ([Note: composition] in compose.py; [Note: tensor-parallel parameters] in
strategies/parts/tensor_parallel.py); `dp.compose` builds the same mesh when given none. The
data rank is the dp coordinate: the T peers of a row read the same windows and compute the same
loss: [Note: loss normalisation] scales by the dp size, and in the sums the trainer makes over
every rank (target tokens, the loss, validation) only the first rank of each row counts them. With T = 1 all of this is the plain 1-D world.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dataparallel as dp

from ..models import MODEL_CONFIGS, build_model
from .config import ConfigError, RunConfig, field_label


def check_tp(config: RunConfig) -> None:
    """One-line errors for a --tp that cannot split this run's model (no I/O but an hf:DIR's
    config); --tp against the ranks is the layout's rule (`RunConfig.layout`)."""
    tp, label = config.layout.tp, field_label("launch", "tp")
    if tp == 1:
        return
    shape = MODEL_CONFIGS.get(config.model.name)
    if not hasattr(shape, "n_head"):
        raise ConfigError(
            label,
            f"{config.model.name} has no tensor-parallel plan",
            "use a reference GPT (gpt-tiny, gpt-small, gpt-medium), or --tp 1",
        )
    for what, size in (("heads", shape.n_head), ("width", shape.n_embd)):  # heads | width
        if size % tp:
            raise ConfigError(
                label,
                f"{tp} does not divide {config.model.name}'s {size} {what}",
                f"use a divisor of {size}",
            )


def build_mesh(world: dp.World, tp: int) -> DeviceMesh | None:
    """The ("dp", "tp") mesh of the world ([Note: the job's mesh]); None for tp 1. Collective."""
    if tp <= 1:
        return None
    shape = (world.world_size // tp, tp)
    return init_device_mesh(world.device.type, shape, mesh_dim_names=("dp", "tp"))


def mesh_text(world_size: int, tp: int) -> str:
    """How progress and reports name the layout: "4 ranks" or "4 = dp 2 x tp 2"."""
    return f"{world_size} ranks" if tp <= 1 else f"{world_size} = dp {world_size // tp} x tp {tp}"


def parameter_count(model: nn.Module, config: RunConfig) -> int:
    """The whole model's parameters: under --tp a rank holds parts, so the run's model is
    counted on the meta device."""
    if config.launch.tp > 1:  # a reference GPT (check_tp): its whole model on the meta device
        with torch.device("meta"):
            model = build_model(config.model.name)
    return sum(p.numel() for p in model.parameters())

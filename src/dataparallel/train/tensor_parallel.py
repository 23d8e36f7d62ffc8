"""`dataparallel train --tp T`: the ("dp", "tp") mesh, the reference GPT's tensor-parallel plan,
and which ranks read which data.

[Note: the job's mesh] A world of N ranks is a DeviceMesh of dp = N / T rows and tp = T columns,
rank r at (r // T, r % T): tensor-parallel peers are consecutive ranks, so on several hosts the
activation all-reduces (two per block and direction) stay inside a host. The reference GPT is
split over mesh["tp"] first (PyTorch's `parallelize_module`, `split_gpt`), then `dp.compose`
runs the strategy over mesh["dp"] only (its `mesh=`; [Note: tensor-parallel parameters] in
strategies/parts/tensor_parallel.py). The data rank is the dp coordinate: the T peers of a row
read the same windows and compute the same loss: [Note: loss normalisation] scales by the dp
size, and in the sums the trainer makes over every rank (target tokens, the loss, validation)
only the first rank of each row counts them. With T = 1 all of this is the plain 1-D world.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dataparallel as dp

from ..models import MODEL_CONFIGS, build_model
from .config import ConfigError, RunConfig, field_label
from .state import DataRanks


def check_tp(config: RunConfig) -> None:
    """One-line errors for a --tp that cannot split this run (no I/O but an hf:DIR's config)."""
    tp, label = config.launch.tp, field_label("launch", "tp")
    if tp < 1:
        raise ConfigError(label, f"{tp} is below 1", "use 1 (no tensor parallelism) or more")
    if tp == 1:
        return
    if config.world_size % tp:
        raise ConfigError(
            label, f"{tp} does not divide the {config.world_size} ranks", "use a divisor of them"
        )
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


def data_ranks(world: dp.World, mesh: DeviceMesh | None) -> DataRanks:
    """This rank's data coordinate, the number of data slices, and whether its sums count."""
    if mesh is None:
        return DataRanks(world.rank, world.world_size)
    rows = mesh["dp"]
    return DataRanks(rows.get_local_rank(), rows.size(), mesh["tp"].get_local_rank() == 0)


def split_gpt(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split each block of the reference GPT over `tp_mesh` ([Note: local heads] in
    models/gpt.py): q, k, v and the MLP's first linear by output rows (ColwiseParallel), the
    attention's output projection and the MLP's second linear by input columns
    (RowwiseParallel), so each rank computes its heads and its quarter-width slice of the MLP
    and one all-reduce per sub-layer and direction joins them. Embeddings, norms and the head
    stay whole (replicated over "tp")."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def split_for_run(
    model: nn.Module, world: dp.World, tp: int
) -> tuple[DeviceMesh | None, DataRanks]:
    """Split the run's GPT over "tp" ([Note: the job's mesh]); return mesh["dp"], for
    `dp.compose(mesh=)` (None for tp 1: the whole world), and this rank's data ranks."""
    mesh = build_mesh(world, tp)
    if mesh is None:
        return None, data_ranks(world, None)
    split_gpt(model, mesh["tp"])
    return mesh["dp"], data_ranks(world, mesh)


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

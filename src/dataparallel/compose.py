"""Composition: strategy x mesh x precision x compression x averager, in one documented order.

[Note: composition] `compose(model, recipe, optimizer_cls, ...)` is the one place that decides
how the pieces combine; `dataparallel train` calls it with the recipe its flags spell, so a
script gets exactly what the CLI gets. The order, and why:
1. precision (`Recipe.precision`) fixes the strategy's `MixedPrecision` (the dtype of the
   parameters, buckets and wire), autocast, and whether a loss scaler runs: it must be known
   before anything is laid out, since the flat buffers are allocated in it;
2. the mesh: the strategy shards within a shard group (`shard_size` ranks, or every rank) and
   the replicas all-reduce across groups (HSDP); with an averager the strategy runs inside each
   replica only and the averager owns the cross-replica step;
3. compression (`compress`) is the strategy's communication hook: it acts on the reduction's
   stage that crosses replicas ([Note: where compression acts] in compression/hook.py), after
   the in-group reduction has averaged what is exact and cheap;
4. accumulation (`dp.no_sync`) runs before any of it: compressed or not, a bucket is reduced
   once per optimizer step;
5. the optimizer is built on what each rank holds (`dp.build_optimizer`), after the strategy,
   since sharded strategies build it on their shards;
6. an averager (`local_sgd`, `diloco`) replaces the cross-replica gradient reduction
   altogether and synchronises the replicas' parameters every H steps after the optimizer
   step; compressing gradients would then only compress the fast in-replica links, so the two
   are not combined, and DiLoCo's outer gradients are compressed instead (`outer_compress`).
A tensor-parallel model (split with PyTorch's `parallelize_module` beforehand) composes over
the data-parallel dimension only: `compose(..., mesh=mesh["dp"])` runs all of the above over
that dimension's group, so precision acts on the local tensors and compression on the dp
reduction, never on DTensor's activation all-reduces (docs/core.md, "Hybrid parallelism").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .api import build_optimizer, parallelize
from .averaging import DiLoCo, LocalSGD
from .comm import Tracer
from .recipe import PRECISIONS, Recipe, check_recipe
from .strategies import Mesh, init_mesh


@dataclass
class Composed:
    """What `compose` built.

    model: the parallelized model (the one passed in, wrapped in place).
    optimizer: built on what this rank holds.
    averager: the `LocalSGD` or `DiLoCo` to `.step()` after each optimizer step, or None.
    mesh: the replicate x shard layout, or None on a 1-D world.
    scaler: the `torch.amp.GradScaler` for "fp16" (scale the loss, `scaler.step(optimizer)`),
        or None.
    recipe: what was composed.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    averager: LocalSGD | None
    mesh: Mesh | None
    scaler: torch.amp.GradScaler | None
    recipe: Recipe
    tracer: Tracer = field(default_factory=Tracer)

    def autocast(self):
        """The forward's autocast context for the recipe's precision (a no-op without one)."""
        dtype = self.recipe.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=dtype)


def compose(
    model: nn.Module,
    recipe: Recipe,
    optimizer_cls=torch.optim.AdamW,
    *,
    params=None,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    tracer: Tracer | None = None,
    **optimizer_kwargs,
) -> Composed:
    """Parallelize `model` and build its optimizer and averager as `recipe` says, in the order
    of [Note: composition]. `params` are the optimizer's param groups (default: every trainable
    parameter); `group` the ranks (default: every rank); `mesh` instead of `group`: the
    data-parallel dimension of a torch DeviceMesh (`mesh["dp"]` of a ("dp", "tp") mesh, the
    model split over "tp" beforehand), over which everything below runs as over a group, the
    HSDP layout and an averager's replicas included; `tracer` records the collectives.
    Collective: every rank calls it with the same model and recipe."""
    check_recipe(recipe, model)
    tracer = tracer or Tracer()
    if mesh is not None:  # [Note: device mesh] in strategies/parts/mesh.py: 1-D = its group
        if mesh.ndim != 1:
            raise ValueError(
                f"compose: mesh has {mesh.ndim} dimensions; pass the data-parallel one "
                "(mesh['dp']) and give Recipe.shard_size for HSDP"
            )
        group = mesh.get_group()
    policy = recipe.policy()  # 1. precision, 3. compression: the strategy's own fields
    names = {id(p): name for name, p in model.named_parameters()}
    world_size = dist.get_world_size(group)
    mesh, replicas = None, None
    if recipe.averaging:  # 2. the strategy runs inside each replica; 6. the averager across
        mesh = init_mesh(recipe.shard_size or 1, group)
        parallelize(model, policy, group=mesh.shard_group, tracer=tracer)
        replicas = mesh.replicate_group
    elif 0 < recipe.shard_size < world_size or recipe.elastic and recipe.shard_size > 1:
        mesh = init_mesh(recipe.shard_size, group, elastic=recipe.elastic)  # 2. 2-D (HSDP)
        parallelize(model, policy, mesh=mesh, tracer=tracer)
    else:
        parallelize(model, policy, group=group, tracer=tracer)
    params = _rebind(params, names, model)
    optimizer = build_optimizer(model, optimizer_cls, params=params, **optimizer_kwargs)  # 5.
    averager = _averager(recipe, model, optimizer, replicas, tracer) if replicas else None
    scaler = None
    if PRECISIONS[recipe.precision][2]:
        scaler = torch.amp.GradScaler(next(model.parameters()).device.type)
    return Composed(model, optimizer, averager, mesh, scaler, recipe, tracer)


def _rebind(params, names: dict[int, str], model: nn.Module):
    """Param groups made before `parallelize` may hold a tensor-parallel model's DTensors,
    which it replaced by local parameters under the same names ([Note: tensor-parallel
    parameters]): give the groups those."""
    if params is None:
        return None
    params = list(params)  # a generator is read once
    groups = [g if isinstance(g, dict) else {"params": [g]} for g in params]
    if not any(isinstance(p, DTensor) for g in groups for p in _listed(g["params"])):
        return params
    now = dict(model.named_parameters())

    def swap(p):
        return now[names[id(p)]] if isinstance(p, DTensor) else p

    return [{**g, "params": [swap(p) for p in _listed(g["params"])]} for g in groups]


def _listed(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _averager(recipe: Recipe, model, optimizer, group, tracer):
    if recipe.local_sgd:
        return LocalSGD(model, optimizer, recipe.local_sgd, group=group, tracer=tracer)
    outer = partial(
        torch.optim.SGD,
        lr=recipe.outer_lr,
        momentum=recipe.outer_momentum,
        nesterov=recipe.outer_momentum > 0,
    )
    streaming = recipe.streaming  # [Note: the DiLoCo recipe]
    return DiLoCo(
        model,
        optimizer,
        recipe.diloco,
        group=group,
        outer_optimizer=outer,
        compress=streaming.compress,
        tracer=tracer,
        fragments=streaming.fragments,
        overlap=streaming.overlap,
        mix=recipe.mix,
        warmup=streaming.warmup,
    )

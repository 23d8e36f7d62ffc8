"""Composition: tensor parallelism x activation checkpointing x compile x strategy x mesh x
precision x compression x averager, in one documented order.

[Note: composition] `compose(model, recipe, optimizer_cls, ...)` is the one place that decides
how the pieces combine; `dataparallel train` calls it with the recipe its flags spell, so a
script gets exactly what the CLI gets. It transforms the model as torchtitan's
`parallelize_llama` does (tensor parallelism, activation checkpointing, compile, data
parallelism), then builds the optimizer and the averager. The order, and why:
1. tensor parallelism (`Recipe.tp`) splits the model over "tp" with its own plan (PyTorch's
   `parallelize_module`): it decides what the local parameters are, which everything below
   acts on, and its DTensor hooks sit on the linears, inside the blocks;
2. activation checkpointing (`Recipe.activation_checkpointing`) replaces each block's forward
   by its recomputed form: the split linears are recomputed with it, and the strategy's hooks,
   registered in 4, stay outside it ([Note: checkpoint inside the unit]);
3. compile (`Recipe.compile`) compiles each block after 2, so the recompute is in the compiled
   block, and before 4, whose hooks are opaque to the compiler ([Note: compile] in
   strategies/zero3/strategy.py): a block's forward is one graph under every strategy;
4. data parallelism: the strategy over the ranks (over "dp" after 1), with
   a. precision (`Recipe.precision`): the strategy's `MixedPrecision` (the dtype of the
      parameters, buckets and wire), autocast, and whether a loss scaler runs: it must be known
      before anything is laid out, since the flat buffers are allocated in it;
   b. the mesh: the strategy shards within a shard group (`shard_size` ranks, or every rank)
      and the replicas all-reduce across groups (HSDP); with an averager the strategy runs
      inside each replica only and the averager owns the cross-replica step;
   c. compression (`compress`) as the strategy's communication hook: it acts on the
      reduction's stage that crosses replicas ([Note: where compression acts] in
      compression/hook.py), after the in-group reduction has averaged what is exact and cheap;
   d. accumulation (`dp.no_sync`) before any of it: compressed or not, a bucket is reduced
      once per optimizer step;
5. the optimizer is built on what each rank holds (`dp.build_optimizer`), after the strategy,
   since sharded strategies build it on their shards; param groups made on the model as it was
   passed in are given the parameters that 1 and 4 put under the same names;
6. an averager (`local_sgd`, `diloco`) replaces the cross-replica gradient reduction
   altogether and synchronises the replicas' parameters every H steps after the optimizer
   step; compressing gradients would then only compress the fast in-replica links, so the two
   are not combined, and DiLoCo's outer gradients are compressed instead (`outer_compress`).
A model split beforehand (PyTorch's `parallelize_module` with a plan of one's own) composes
the same way over the data-parallel dimension: `compose(..., mesh=mesh["dp"])` runs 2-6 over
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .activation_checkpointing import checkpoint_activations
from .api import build_optimizer, parallelize
from .averaging import DiLoCo, LocalSGD, OuterSettings
from .comm import Tracer
from .recipe import PRECISIONS, Recipe, RecipeError, check_recipe, check_tp_mesh
from .strategies import Layout, Mesh, init_mesh, select_units


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
    tracer: records the collectives.
    device_mesh: the ("dp", "tp") DeviceMesh the model was split over (`Recipe.tp`), or None.
    layout: the parallel layout of the composed world ([Note: layout] in
        strategies/parts/parallel_layout.py): which ranks read which data, shard, replicate
        and count the loss; what the job, its checkpoints and live recovery read.
    outer: DiLoCo's outer settings as resolved for this run (given, or chosen: [Note: the
        outer learning rate] in averaging/outer_settings.py), or None without DiLoCo.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    averager: LocalSGD | None
    mesh: Mesh | None
    scaler: torch.amp.GradScaler | None
    recipe: Recipe
    tracer: Tracer = field(default_factory=Tracer)
    device_mesh: DeviceMesh | None = None
    layout: Layout | None = None
    outer: OuterSettings | None = None

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
    """Transform `model` and build its optimizer and averager as `recipe` says, in the order of
    [Note: composition]. `params` are the optimizer's param groups (default: every trainable
    parameter), made on `model` as it is passed in; `group` the ranks (default: every rank);
    `mesh` instead of `group`: the data-parallel dimension of a torch DeviceMesh (`mesh["dp"]`
    of a ("dp", "tp") mesh, the model split over "tp" beforehand), over which everything below
    runs as over a group, the HSDP layout and an averager's replicas included; or, with
    `Recipe.tp`, the whole ("dp", "tp") mesh to split over (default: one over every rank,
    "tp" peers on consecutive ranks). `tracer` records the collectives.
    Collective: every rank calls it with the same model and recipe."""
    world_size = dist.get_world_size(group) if mesh is None else mesh.size()
    check_recipe(recipe, model, world_size)
    layout = recipe.layout(world_size)  # [Note: layout]: built here, once
    if mesh is not None and recipe.tp > 1:
        check_tp_mesh(recipe, mesh)
    elif mesh is not None and mesh.ndim != 1:
        raise ValueError(
            f"compose: mesh has {mesh.ndim} dimensions; pass the data-parallel one "
            "(mesh['dp']) and give Recipe.shard_size for HSDP, or give Recipe.tp to split"
        )
    tracer = tracer or Tracer()
    names = {id(p): name for name, p in model.named_parameters()}  # before any transform
    device_mesh, mesh = _split(model, recipe, group, mesh)  # 1. tensor parallelism
    if recipe.activation_checkpointing:  # 2. [Note: checkpoint inside the unit]
        checkpoint_activations(model)
    if recipe.compile:  # 3. each block, checkpoint included
        for block in select_units(model, None) or [model]:
            block.compile()
    if mesh is not None:  # [Note: device mesh] in strategies/parts/mesh.py: 1-D = its group
        group = mesh.get_group()
    two_d, replicas = _data_parallel(model, recipe, layout, group, tracer)  # 4.
    params = _rebind(params, names, model)
    optimizer = build_optimizer(model, optimizer_cls, params=params, **optimizer_kwargs)  # 5.
    averager = outer = None
    if replicas:
        if recipe.diloco:
            outer = recipe.outer(layout.replicas, inner_optimizer(optimizer_cls, params))
        averager = _averager(recipe, outer, model, optimizer, replicas, tracer)
    scaler = None
    if PRECISIONS[recipe.precision].scaling:
        scaler = torch.amp.GradScaler(next(model.parameters()).device.type)
    return Composed(
        model, optimizer, averager, two_d, scaler, recipe, tracer, device_mesh, layout, outer
    )


def _split(model: nn.Module, recipe: Recipe, group, mesh: DeviceMesh | None):
    """1. Split `model` over "tp" with its own plan when `recipe.tp` asks: return the ("dp",
    "tp") mesh and its "dp" dimension, which the data parallelism runs over; else (None, mesh)."""
    if recipe.tp == 1:
        return None, mesh
    if mesh is None:  # [Note: the job's mesh] in train/tensor_parallel.py: tp peers consecutive
        world = dist.get_world_size()
        if group is not None and dist.get_world_size(group) != world:
            raise RecipeError(
                "tp",
                f"a group of {dist.get_world_size(group)} of the {world} ranks is given",
                "pass mesh= the ('dp', 'tp') DeviceMesh to split over",
            )
        shape = (world // recipe.tp, recipe.tp)
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, shape, mesh_dim_names=("dp", "tp"))
    # [Note: imported when used] in strategies/parts/tensor_parallel.py
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], model.tensor_parallel_plan(recipe.tp))
    return mesh, mesh["dp"]


def _data_parallel(model: nn.Module, recipe: Recipe, layout: Layout, group, tracer: Tracer):
    """4. The strategy over `group` (the layout's data ranks) with the recipe's precision and
    compression: return the replicate x shard mesh (or None) and the replicas an averager runs
    across (or None)."""
    policy = recipe.policy()  # 4a. precision, 4c. compression: the strategy's own fields
    if layout.averaged:  # 4b. the strategy runs inside each replica; 6. the averager across
        mesh = init_mesh(layout.shard, group)
        parallelize(model, policy, group=mesh.shard_group, tracer=tracer)
        return mesh, mesh.replicate_group
    if layout.hsdp or recipe.elastic and layout.shard_size > 1:
        mesh = init_mesh(layout.shard_size, group, elastic=recipe.elastic)  # 4b. 2-D (HSDP)
        parallelize(model, policy, mesh=mesh, tracer=tracer)
        return mesh, None
    parallelize(model, policy, group=group, tracer=tracer)
    return None, None


def _rebind(params, names: dict[int, str], model: nn.Module):
    """Param groups made on the model as it was passed in hold parameters that tensor
    parallelism replaced by DTensors, and `parallelize` a tensor-parallel model's DTensors by
    local parameters, each under the same name ([Note: tensor-parallel parameters]): give the
    groups the model's parameters now."""
    if params is None:
        return None
    params = list(params)  # a generator is read once
    groups = [g if isinstance(g, dict) else {"params": [g]} for g in params]
    now = dict(model.named_parameters())
    current = {id(p) for p in now.values()}
    if all(id(p) in current for g in groups for p in _listed(g["params"])):
        return params

    def swap(p):
        return p if id(p) in current or id(p) not in names else now[names[id(p)]]

    return [{**g, "params": [swap(p) for p in _listed(g["params"])]} for g in groups]


def _listed(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def inner_optimizer(optimizer_cls, params=None) -> str:
    """ "muon" when Muon is the class of the optimizer or of a param group, else "adamw": the
    inner optimizer's row of the outer settings ([Note: the outer learning rate])."""
    muon = getattr(torch.optim, "Muon", None)
    classes = [optimizer_cls] + [g.get("optimizer") for g in params or () if isinstance(g, dict)]
    is_muon = muon is not None and any(isinstance(c, type) and issubclass(c, muon) for c in classes)
    return "muon" if is_muon else "adamw"


def _averager(recipe: Recipe, outer: OuterSettings, model, optimizer, group, tracer):
    if recipe.local_sgd:
        return LocalSGD(model, optimizer, recipe.local_sgd, group=group, tracer=tracer)
    outer_optimizer = partial(
        torch.optim.SGD, lr=outer.lr, momentum=outer.momentum, nesterov=outer.momentum > 0
    )
    streaming = recipe.streaming  # [Note: the DiLoCo recipe]
    return DiLoCo(
        model,
        optimizer,
        recipe.diloco,
        group=group,
        outer_optimizer=outer_optimizer,
        compress=streaming.compress,
        tracer=tracer,
        fragments=streaming.fragments,
        overlap=streaming.overlap,
        mix=recipe.mix,
        warmup=streaming.warmup,
    )

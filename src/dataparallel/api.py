"""The public calls: `parallelize` a model, `build_optimizer` for it, and what follows.

Each call after `parallelize` finds the strategy attached to the model and forwards to it, so
user code reads the same whatever the strategy (DDP, ZeRO-1/2/3).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .comm import Comm, Tracer
from .comm.dry import is_fake
from .strategies import (
    GROUP_CLASS_KEY,
    Geometry,
    Grouped,
    Groups,
    Handle,
    Mesh,
    OptimizerLayoutWarning,
    PlainCopy,
    Strategy,
    apply_policy,
    as_layout,
    bind_dtensor_views,
    check_apart,
    install_flat_step,
    is_carrier,
    layout_of,
    load_local,
    local_state_dict,
    localize_parameters,
    next_hook_id,
    resolve_policy,
    split_classes,
    unknown_notice,
)

_ATTR = "_dataparallel_strategy"


def parallelize(
    model: nn.Module,
    strategy="ddp",
    *,
    group: dist.ProcessGroup | None = None,
    mesh: Mesh | DeviceMesh | None = None,
    tracer: Tracer | None = None,
    pairwise: bool | None = None,
) -> nn.Module:
    """Apply a data-parallel strategy to `model` in place and return it.

    strategy: a name ("ddp", "zero1", "zero2", "zero3") or a policy object such as
        `DDP(bucket_mb=25)`.
    group: the process group to train over; None is every rank (call `dataparallel.init()`).
    mesh: the data-parallel ranks as a torch `DeviceMesh` or a `dataparallel.Mesh` ([Note:
        device mesh] in strategies/parts/mesh.py). One dimension: the group to train over
        (e.g. `mesh["dp"]` of a ("dp", "tp") mesh, the other dimensions left to the model's
        DTensor parameters). Two dimensions named ("replicate", "shard"), or
        `dataparallel.init_mesh(shard_size)`: HSDP (docs/core.md), sharded strategies shard
        within each group of `shard_size` ranks and all-reduce across the groups. None shards
        over every rank (or `group`). Replaces `group`.
    tracer: records when collectives start and finish (see `comm.Tracer`).
    pairwise: build reduce-scatter and all-gather from point-to-point messages; None means
        yes on gloo, where that costs half of gloo's own collectives, no on NCCL (see
        `comm.Comm`; the sharded strategies use them, DDP's all-reduce is gloo's).

    A model split with PyTorch's tensor parallelism (DTensor parameters on other dimensions
    of the mesh) is taken as it is: its local tensors are replicated or sharded over `mesh`
    only, gradients reduced over it only, DTensor runs the tensor-parallel collectives, and
    `clip_grad_norm_`, `full_state_dict` and the plain optimizer state see the whole tensors
    (docs/core.md, "Hybrid parallelism").

    `copy.deepcopy(model)` (and so torch's `AveragedModel`) gives a plain module with the
    current weights under DDP and ZeRO-1/2, and is refused under ZeRO-3 ([Note: model copies]
    in strategies/model_copy.py; `dataparallel.EMA` is the sharded EMA for every strategy).

    Collective: every rank of the group must call it, with the same model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be an nn.Module, got {type(model).__name__}")
    if pairwise is not None and not isinstance(pairwise, bool):
        raise TypeError(f"parallelize: pairwise={pairwise!r} must be True, False or None (auto)")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("parallelize: this model is already parallelized; wrap it only once")
    if not dist.is_initialized():
        raise RuntimeError("parallelize: no process group; call dataparallel.init() first")
    if mesh is not None and group is not None:
        raise ValueError("parallelize: pass a group or a mesh (built over a group), not both")
    if mesh is not None:
        group, mesh = as_layout(mesh)
    policy = resolve_policy(strategy)
    on_meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    dry = is_fake(group if group is not None else None)  # [Note: dry run] in comm/dry.py
    if on_meta is not None and getattr(policy, "materialize", None) is None and not dry:
        raise ValueError(
            f"parallelize: parameter {on_meta!r} is on the meta device; give it values first, "
            "or shard it as it is filled with dataparallel.ZeRO3(materialize=...)"
        )
    # DTensor parameters (tensor parallelism on other mesh dimensions) become their local
    # tensors for the strategy, and DTensor views again at each forward, after the strategy's
    # hooks ([Note: tensor-parallel parameters] in strategies/parts/tensor_parallel.py).
    groups = Groups.build(group, mesh, tracer, pairwise)
    check_apart(model, groups.world.group)
    first_hook = next_hook_id()  # hooks from here on are the strategy's ([Note: model copies])
    localized = localize_parameters(model)
    instance = apply_policy(policy, model, groups)
    bind_dtensor_views(localized)
    object.__setattr__(model, _ATTR, instance)
    object.__setattr__(model, "__deepcopy__", PlainCopy(instance, first_hook, _ATTR))
    return model


def strategy_of(model: nn.Module) -> Strategy:
    """The strategy `parallelize` attached to `model` (an error if there is none)."""
    instance = getattr(model, _ATTR, None)
    if instance is None:
        raise ValueError(
            "this model was not parallelized; call dataparallel.parallelize(model) first"
        )
    return instance


def handle_of(model: nn.Module) -> Handle:
    """The narrow handle on a parallelized model: its geometry, refresh, no_sync, rebind, the
    replica group ([Note: the handle] in strategies/handle.py); what features build on."""
    return Handle(strategy_of(model))


def rebind(model: nn.Module, group) -> None:
    """Train `model` over `group` from now on, its state kept as it is: a live run's next
    generation after a replica was lost or joined (dataparallel train --recovery live); drop
    the gradients of a step interrupted half-way.

    group: a ProcessGroup for DDP (every rank holds the same state); for ZeRO-1/2 on a 2-D
        mesh, the new `Mesh` (`dp.init_mesh(S, group, elastic=True)`), whose shard groups
        have the model's S ranks in the same places: each rank keeps its shards, and only the
        replicas change.
    """
    strategy_of(model).rebind(group)


def build_optimizer(
    model: nn.Module,
    optimizer,
    params=None,
    *,
    elementwise: bool | None = None,
    reads: str | None = None,
    **kwargs,
) -> torch.optim.Optimizer:
    """Build the optimizer for a parallelized model.

    optimizer: a `torch.optim.Optimizer` class (built here, on shards for sharded strategies)
        or, for DDP, an optimizer already built on this model's parameters (checked).
    params: optional parameters or param-group dicts of this model (default: all trainable).
    reads: what the class's update of one element reads, which decides its layout under
        ZeRO-1/2/3 ([Note: optimizer layout] in strategies/parts/optimizer_layout.py,
        docs/optimizers.md): "element" (flat shards), "parameter" (whole parameters on
        balanced owners), "group" (each param group on one owner) or "all" (every parameter
        on one owner). None: torch's classes by their kind (SGD, Adam, AdamW, ... "element";
        Adafactor, Muon "parameter"); any other class "all", exact whatever its update reads,
        which `build_optimizer` says in one line with how to declare a cheaper layout.
    elementwise: the older form of the declaration: True is reads="element", False
        reads="parameter".
    kwargs: passed to the optimizer class (lr, weight_decay, ...).

    A param group may name its own class under "optimizer" (Muon on the matrices, AdamW on the
    rest, one optimizer for one scheduler: [Note: grouped optimizer] in
    strategies/parts/grouped.py); the keyword arguments go to `optimizer`'s class, a group's
    other class takes its hyper-parameters from the group. Two calls on one model (one
    optimizer each, as with PyTorch's DDP) work too, on every strategy, all before the first
    step.
    """
    strategy = strategy_of(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        if params is not None or kwargs or elementwise is not None or reads is not None:
            raise ValueError(
                "build_optimizer: pass an optimizer class with its arguments, or a built "
                "optimizer alone"
            )
        return strategy.adopt_optimizer(optimizer)
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(
            f"build_optimizer: optimizer must be a torch.optim.Optimizer class, got {optimizer!r}"
        )
    groups = None if params is None else list(params)
    if groups and isinstance(groups[0], dict) and any(GROUP_CLASS_KEY in g for g in groups):
        # [Note: grouped optimizer]: a group may name its own class (Muon + AdamW)
        groups, classes = split_classes(groups, optimizer)
        mine = (elementwise, reads)
        layouts = [layout_of(c, *(mine if c is optimizer else (None, None))) for c in classes]
        _tell_layouts(strategy, classes, layouts)
        per_group = [read for read, _ in layouts]
        return strategy.build_optimizer(
            Grouped(classes, optimizer), groups, reads=per_group, **kwargs
        )
    read, known = layout_of(optimizer, elementwise, reads)
    _tell_layouts(strategy, [optimizer], [(read, known)])
    built = strategy.build_optimizer(optimizer, groups, reads=read, **kwargs)
    return install_flat_step(built) if read == "element" else built  # [Note: flat step]


def _tell_layouts(strategy: Strategy, classes: list[type], layouts: list[tuple[str, bool]]) -> None:
    """Once, on rank 0, the one line for each class the engine does not know, where the layout
    matters (a shard group of more than one rank)."""
    groups = strategy.groups
    if groups is None or groups.shard.world_size == 1 or dist.get_rank() != 0:
        return
    for cls in dict.fromkeys(
        c for c, (_, known) in zip(classes, layouts, strict=True) if not known
    ):
        warnings.warn(unknown_notice(cls, strategy.name), OptimizerLayoutWarning, stacklevel=3)


def no_sync(model: nn.Module):
    """Context manager: backward passes inside it accumulate locally, with no communication."""
    return strategy_of(model).no_sync()


def finish_param_gather(model: nn.Module) -> None:
    """Make the model's parameters whole before reading or writing them directly after `step()`.

    Needed only with ZeRO-1/2's `overlap_param_gather=True`, between `optimizer.step()` and the
    next forward, for code that touches parameters itself (an EMA, a weight norm, a clamp);
    forwards, state_dict calls and checkpoints wait by themselves. A no-op otherwise. Not
    collective.
    """
    strategy_of(model).finish_param_gather()


def refresh_params(model: nn.Module) -> None:
    """After changing the optimizer's parameters outside `step()` (an averager such as DiLoCo
    writes into them), make the model's parameters follow: ZeRO-1/2 write their shards back
    and all-gather them again (collective over the shard group); a no-op for DDP and ZeRO-3."""
    strategy_of(model).refresh_params()


def bytes_sent(model: nn.Module) -> int:
    """Bytes this rank has handed to the strategy's collectives so far (payload sizes, as
    `comm.Comm` counts them). Take differences for a step's bytes."""
    return sum(comm.total_bytes() for comm in strategy_of(model).comms())


def wire_bytes(model: nn.Module) -> int:
    """Bytes this rank has put on its links for the strategy's collectives so far, from each
    collective's algorithm ([Note: bytes on the wire] in comm/wire.py). Take differences for a
    step's bytes."""
    return sum(comm.total_wire_bytes() for comm in strategy_of(model).comms())


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm across ranks and shards; return that norm.

    `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` gives the same result on every
    strategy ([Note: sharded gradients] in strategies/parts/sharded_grads.py); this one also
    counts tensor-parallel parameters over "tp" under DDP. Collective."""
    return strategy_of(model).clip_grad_norm_(max_norm, norm_type)


def clip_grad_value_(model: nn.Module, clip_value: float) -> None:
    """Clamp every element of the reduced gradient into [-clip_value, clip_value], where it
    lives (`torch.nn.utils.clip_grad_value_`'s result; elementwise, so no collective)."""
    if not float(clip_value) >= 0:
        raise ValueError(f"clip_grad_value_: clip_value={clip_value} must be >= 0")
    strategy_of(model).clip_grad_value_(clip_value)


def grad_norms(model: nn.Module, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
    """Per parameter name, the norm of its reduced gradient (what `p.grad.norm(norm_type)` is
    in one process; parameters without a gradient left out), on every rank. For logging under
    any strategy. Collective under ZeRO-1/2/3 (one all-reduce), local under DDP."""
    return strategy_of(model).grad_norms(norm_type)


def geometry(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Geometry:
    """What this rank holds of each parameter of a parallelized model ([Note: geometry] in
    strategies/parts/geometry.py): the runs of the flattened parameters, the tensors the
    optimizer updates for them, and the group over which they fit together. The state dicts,
    sharded checkpoints and memory reports are derived from it."""
    return strategy_of(model).geometry(optimizer)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded model state on CPU, on every rank (collective for sharded ones).

    Its keys are those of the plain model, so `nn.Module.load_state_dict` takes it as is.
    """
    return strategy_of(model).full_state_dict()


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a whole-model state dict (as `full_state_dict` returns) into a parallelized model."""
    strategy_of(model).load_full_state_dict(state_dict)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state in the form of a plain optimizer over `model.parameters()`."""
    return strategy_of(model).optimizer_state_dict(optimizer)


def load_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load what `optimizer_state_dict` returned (from any strategy) into `optimizer`."""
    strategy_of(model).load_optimizer_state_dict(optimizer, state)


def local_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's optimizer state as torch keeps it (its shards or owned masters under
    ZeRO-1/2/3, where `optimizer.state_dict()` is refused): to load back on this same rank
    (a rewind), never a checkpoint; `optimizer_state_dict` is the portable one. Not collective."""
    return local_state_dict(optimizer)


def load_local_optimizer_state_dict(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load what `local_optimizer_state_dict` returned on this rank. Not collective."""
    load_local(optimizer, state)


def held_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors `optimizer` updates on this rank: what it holds of the model (pieces, owned
    masters, or DDP's parameters), without a sharded optimizer's found-inf carrier ([Note:
    torch's own calls] in strategies/parts/torch_calls.py)."""
    return [p for group in optimizer.param_groups for p in group["params"] if not is_carrier(p)]


def memory_report(model: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state."""
    return strategy_of(model).memory_report(optimizer)


def join(batches: Iterable, group: dist.ProcessGroup | None = None) -> Iterator:
    """Yield from `batches` while every rank still has a batch; stop all ranks together.

    For uneven inputs: a rank that runs out early would otherwise leave the others waiting
    forever in their next gradient all-reduce. Before each batch the ranks agree (one tiny
    all-reduce) whether all of them have one; when any rank is out, all stop at that step, and
    the longer ranks' extra batches are not trained on. `DistributedSampler` avoids the case
    altogether by giving every rank the same number of samples.
    """
    comm = Comm(group)
    iterator = iter(batches)
    flag = torch.zeros(1, dtype=torch.int32, device=comm.device)
    while True:
        try:
            batch, has_batch = next(iterator), 1
        except StopIteration:
            batch, has_batch = None, 0
        flag.fill_(has_batch)
        if comm.world_size > 1:
            comm.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 0:
            return
        yield batch

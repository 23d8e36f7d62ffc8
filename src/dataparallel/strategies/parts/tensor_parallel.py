"""Tensor-parallel parameters: DTensors whose local tensors data parallelism replicates or shards.

[Note: tensor-parallel parameters] A model split with PyTorch's tensor-parallel API
(`parallelize_module(model, mesh["tp"], plan)`) holds DTensor parameters: on each rank a local
tensor (its tensor-parallel shard, or a replica) and the placements that say how the local
tensors make the whole. Data parallelism over `mesh["dp"]` must treat each local tensor as the
parameter: tensor-parallel peers hold different local tensors and data-parallel peers the same
ones, so the dp ranks of one tp coordinate replicate or shard exactly those.

`localize_parameters` does that once, before the strategy is built: each DTensor parameter is
replaced, under the same name, by a plain `nn.Parameter` over its local tensor, which every
strategy then handles as any other parameter (buckets, flat shards, ZeRO-3's gathered views,
the optimizer's pieces). The placements are kept on that parameter (`TensorParallel`, read by
`tensor_parallel_of`). `bind_dtensor_views` then (after the strategy's own hooks, so that
ZeRO-3 has gathered) gives the module, at each forward, the DTensor its code expects: a
`DTensor.from_local` view of the local parameter, set as the module's attribute (the instance
attribute shadows the entry of `_parameters`, which keeps the plain one). Autograd carries the
gradient back through `from_local`, whose backward brings it to the parameter's placements
(DTensor's own collectives over "tp"), so the local parameter's `.grad` is the local tensor of
the tensor-parallel gradient, and the strategy reduces it over "dp" only, as any gradient.

What follows from the placements, computed here and nowhere else:
- whole tensors (`whole`: the dp-assembled local tensor, then `full_tensor()` over "tp"), so
  `dp.full_state_dict` and the plain optimizer state are those of the unsplit model;
- the local part of a whole tensor (`local_part`, no collective), for loading them;
- the groups over which a parameter's local tensors are disjoint (`norm_groups`, its Shard
  dimensions), over which squared gradient norms are summed; a Replicate dimension is counted
  once.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from ...torch_internals import local_shape_and_offset, registered_parameter, set_parameter
from .opaque import opaque

_ATTR = "_dataparallel_tensor_parallel"
_DTENSOR = "torch.distributed.tensor"
Spread = tuple[dist.ProcessGroup, ...]  # groups over which a gradient's parts are disjoint


@dataclass(frozen=True)
class TensorParallel:
    """How a local parameter is part of its DTensor ([Note: tensor-parallel parameters]).

    mesh: the DTensor's mesh (the tensor-parallel dimensions, not data parallelism's).
    placements: its placements on `mesh` (Shard(d) or Replicate() per mesh dimension).
    shape: the whole tensor's shape.
    stride: the whole tensor's stride.
    """

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def view(self, local: torch.Tensor) -> DTensor:
        """The DTensor over `local` (a view: no copy, gradients flow back to `local`)."""
        return _dtensor().DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from this rank's local one (collective over the mesh), on the
        device of `local`."""
        device = torch.device(self.mesh.device_type)
        view = _dtensor().DTensor.from_local(
            local.to(device),
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )
        return view.full_tensor().to(local.device)

    def local_part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor of `whole` (no collective)."""
        shape, offset = local_shape_and_offset(self.shape, self.mesh, self.placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        return whole[index]

    def runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Where the run [start, stop) of the flattened local tensor lies in the flattened whole
        tensor: (position in the run, offset in the whole, length) per contiguous part, for
        sharded checkpoints ([Note: checkpoint chunks] in checkpoint/dcp.py). A local tensor of
        whole rows (Shard(0)) is one part; one of column blocks (Shard(1)) a part per row."""
        shape, offset = local_shape_and_offset(self.shape, self.mesh, self.placements)
        return flat_runs(tuple(self.shape), tuple(shape), tuple(offset), start, stop)

    def norm_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The mesh dimensions' groups over which the local tensors are disjoint (Shard)."""
        shard = _dtensor().Shard
        return tuple(
            self.mesh.get_group(dim)
            for dim, placement in enumerate(self.placements)
            if isinstance(placement, shard)
        )


def flat_runs(
    whole: tuple[int, ...], local: tuple[int, ...], offset: tuple[int, ...], start: int, stop: int
) -> list[tuple[int, int, int]]:
    """The run [start, stop) of a box (`local` at `offset` inside `whole`, row-major), as
    (position in the run, offset in the flattened whole, length) parts (pure)."""
    if start >= stop:
        return []
    j = len(whole) - 1  # the box is contiguous in the whole over dims j.. (full after j)
    while j > 0 and local[j] == whole[j]:
        j -= 1
    segment = 1
    for size in local[j:]:
        segment *= size
    strides = [1] * len(whole)
    for d in range(len(whole) - 2, -1, -1):
        strides[d] = strides[d + 1] * whole[d + 1]
    out = []
    for index in range(start // segment, (stop - 1) // segment + 1):
        lead, base, rest = index, offset[j] * strides[j], []
        for d in range(j - 1, -1, -1):
            lead, i = divmod(lead, local[d])
            rest.append((d, i))
        base += sum((offset[d] + i) * strides[d] for d, i in rest)
        lo, hi = max(start, index * segment), min(stop, (index + 1) * segment)
        out.append((lo - start, base + lo - index * segment, hi - lo))
    return out


def whole_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor `param` is part of (its own for a plain parameter)."""
    spec = tensor_parallel_of(param)
    return param.shape if spec is None else spec.shape


# [Note: imported when used] torch.distributed.tensor takes 1.3-1.8 s of a core to import
# (it imports sympy), most of `import dataparallel`'s own time (about 5.7 s with it, 3.8 s
# without, torch's 3.5 s included), paid by every fresh process: a user's script under
# `dataparallel launch`, each of its restarts, a Lightning run. DTensor is imported where a
# DTensor is made or read, and a value is a DTensor only if that module was imported already
# (`is_dtensor`). A forked worker inherits what its launcher imported (the checkpoint writer
# imports it there).
@cache
def _dtensor():
    """DTensor's module, imported on first use and looked up once (`view` runs at every forward
    of every split module)."""
    return importlib.import_module(_DTENSOR)


def is_dtensor(value) -> bool:
    """Whether `value` is a DTensor, without importing DTensor's module ([Note: imported when
    used])."""
    module = sys.modules.get(_DTENSOR)
    return module is not None and isinstance(value, module.DTensor)


def tensor_parallel_of(param: torch.Tensor) -> TensorParallel | None:
    """What `param` is part of, if `localize_parameters` made it from a DTensor."""
    return getattr(param, _ATTR, None)


def spread_of(param: torch.Tensor) -> Spread:
    """The groups over which `param`'s local tensors are disjoint; () for a plain one."""
    spec = tensor_parallel_of(param)
    return () if spec is None else spec.norm_groups()


def all_spreads(params) -> tuple[Spread, ...]:
    """The distinct non-empty spreads of `params`, in their order (the same on every rank)."""
    out: list[Spread] = []
    for p in params:
        key = spread_of(p)
        if key and key not in out:
            out.append(key)
    return tuple(out)


def to_whole(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (shaped like `param`) as the whole tensor; itself for a plain parameter.
    Collective over the tensor-parallel mesh for a localized one."""
    spec = tensor_parallel_of(param)
    return local if spec is None else spec.whole(local)


def to_local(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The part of `whole` that `param` holds; `whole` itself for a plain parameter."""
    spec = tensor_parallel_of(param)
    if spec is None or tuple(whole.shape) != tuple(spec.shape):
        return whole
    return spec.local_part(whole)


def localize_parameters(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Replace every DTensor parameter of `model` by a plain parameter over its local tensor,
    under the same name, with its `TensorParallel` attached; return (module, name) of each
    replaced one (a tied parameter is replaced once, under each of its names)."""
    made: dict[int, nn.Parameter] = {}
    replaced = []
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if not is_dtensor(param):
                continue
            if id(param) not in made:
                with torch.no_grad():  # to_local() is differentiable: no graph, same memory
                    local = nn.Parameter(param.to_local().detach(), param.requires_grad)
                spec = TensorParallel(
                    param.device_mesh, tuple(param.placements), param.shape, param.stride()
                )
                setattr(local, _ATTR, spec)
                made[id(param)] = local
            set_parameter(module, name, made[id(param)])
            replaced.append((module, name))
    return replaced


def check_apart(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Refuse DTensor parameters whose mesh shares ranks with the data-parallel `group` (None:
    every rank): data parallelism would average tensor-parallel shards that differ."""
    dp_ranks = set(dist.get_process_group_ranks(group or dist.group.WORLD))
    me = dist.get_rank()
    for name, param in model.named_parameters():
        if not is_dtensor(param):
            continue
        shared = sorted(set(param.device_mesh.mesh.flatten().tolist()) & dp_ranks - {me})
        if shared:
            raise ValueError(
                f"parallelize: parameter {name!r} is a DTensor on a mesh that shares ranks "
                f"{shared} with the data-parallel ranks; pass the data-parallel dimensions only "
                "(mesh['dp']) and split the model over the others (mesh['tp'])"
            )


def bind_dtensor_views(replaced: list[tuple[nn.Module, str]]) -> list:
    """Give each module the DTensor view of its localized parameters, now and at every
    forward, after the hooks registered before (a ZeRO-3 unit's gather). Returns the hooks'
    handles."""
    names: dict[nn.Module, list[str]] = {}
    for module, name in replaced:
        names.setdefault(module, []).append(name)
    handles = []
    for module, owned in names.items():

        def bind(mod, args, owned=owned):
            for name in owned:
                param = registered_parameter(mod, name)
                mod.__dict__[name] = tensor_parallel_of(param).view(param)

        bind(module, ())
        handles.append(module.register_forward_pre_hook(opaque(bind)))
    return handles

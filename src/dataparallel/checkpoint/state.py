"""A parallelized model's training state as named chunks: what this rank saves, and where a load
writes, whatever strategy and world size wrote the checkpoint ([Note: checkpoint chunks] in
dcp.py).

Names (the plain model's names, so a checkpoint moves between strategies and world sizes):

    model/<name>               a parameter in its true shape, each rank the boxes of its held
                               run; a tied one under each of its names; a buffer, whole
    optim/<param>/<key>        the optimizer's elementwise state (Adam's moments) likewise;
                               per-parameter scalars (Adam's `step`) whole
    outer/<param>/<key>        an averager's per-parameter state (DiLoCo's anchor, momentum)
    outer/steps                the averager's step count
    rank<r>/hook/...           rank r's compression state (residuals, PowerSGD's factors)
    rank<r>/outer/...          rank r's DiLoCo outer-gradient residual

With an averager the replicas' parameters and inner optimizer states differ between
synchronisations, so `model/` and `optim/` carry a `replica<k>/` prefix. Rank-local
state (`rank<r>/`) only means something to the same rank in the same layout; a load into
another layout leaves it out (`local=False`), and error feedback starts again from zero.

Stored, each "/" becomes a level of DCP's nesting ([Note: checkpoint chunks] in dcp.py), so that
`dcp_to_torch_save(step-N, file)` gives {"model": <the model's state_dict>, "optim": {<param>:
{<key>: tensor}}, ...} (under "replica<k>" with replicas) and `model.load_state_dict(
torch.load(file)["model"])` takes it strictly. Checkpoints written before (flat tensors,
buffers under `buffer/<name>`) are still read: a load reads each tensor in the shape stored.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..api import geometry, handle_of, load_local_optimizer_state_dict
from ..held import placement, state_kind, whole_shape
from .dcp import Chunk, load_chunks, read_metadata, stored_tensors


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """name -> shape of every parameter and buffer the checkpoint holds (a tensor-parallel
    parameter's whole shape)."""
    return {name: list(whole_shape(t)) for name, t in model.state_dict(keep_vars=True).items()}


def _piece_chunk(flat: torch.Tensor, piece) -> Chunk:
    """The chunk of a run `flat` held for `piece`: at its offset in the parameter, or, for a
    tensor-parallel parameter, in parts of the whole tensor ([Note: checkpoint chunks] in
    dcp.py)."""
    where = placement(piece)
    return Chunk(flat, where.offset, where.numel, where.runs, where.shape)


def _held(model, optimizer, prefix: str) -> tuple[dict[str, Chunk], dict[int, object]]:
    """The chunks of the parameters and buffers this rank holds (saved from, loaded into),
    and its optimized pieces by the id of the tensor the optimizer keys them by."""
    chunks: dict[str, Chunk] = {}
    optimized = {}
    for piece in geometry(model, optimizer).pieces:
        chunks[f"{prefix}model/{piece.name}"] = _piece_chunk(piece.value, piece)
        if piece.key is not None:
            optimized[id(piece.key)] = piece
    for name, buffer in _buffers(model):
        chunks[f"{prefix}model/{name}"] = Chunk(buffer.detach())
    return chunks, optimized


def _tied(model: nn.Module, chunks: dict[str, Chunk], prefix: str) -> dict[str, Chunk]:
    """A tied parameter's chunk under each of its other names too (the same values), so that
    the stored `model` is the model's whole state_dict."""
    first: dict[int, str] = {}
    tied = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, nn.Parameter):
            continue
        head = first.setdefault(id(tensor), name)
        if head != name and f"{prefix}model/{head}" in chunks:
            tied[f"{prefix}model/{name}"] = chunks[f"{prefix}model/{head}"]
    return tied


def state_chunks(model, optimizer, averager=None, *, rank: int, prefix: str = "") -> dict:
    """This rank's chunks of the whole training state (see the module docstring)."""
    chunks, optimized = _held(model, optimizer, prefix)
    chunks.update(_tied(model, chunks, prefix))
    for piece in optimized.values():
        for key, value in optimizer.state.get(piece.key, {}).items():
            name = f"{prefix}optim/{piece.name}/{key}"
            chunks[name] = _state_chunk(name, key, value, piece)
    hook = handle_of(model).stateful_hook()
    if hook is not None:
        data, tensors = hook.state_dict()
        chunks[f"rank{rank}/hook/rounds"] = Chunk(torch.tensor(data["rounds"]))
        for name, tensor in tensors.items():
            chunks[f"rank{rank}/hook/{name}"] = Chunk(tensor.detach())
    if averager is not None:
        chunks.update(_averager_chunks(averager, optimized, rank))
    return chunks


def _state_chunk(name: str, key: str, value, piece) -> Chunk:
    kind = state_kind(key, value, piece)
    if kind == "elementwise":
        return _piece_chunk(value.detach().reshape(-1), piece)
    if kind == "scalar":
        return Chunk(value.detach().reshape(()))
    if torch.is_tensor(value) and piece.whole:  # an owner's, or DDP's: any shape (Adafactor's)
        return Chunk(value.detach())
    raise ValueError(
        f"checkpoint: optimizer state {name!r} is neither elementwise nor a scalar tensor; "
        "sharded checkpoints hold such state only"
    )


def _averager_chunks(averager, by_key: dict, rank: int) -> dict[str, Chunk]:
    state = averager.state_dict()  # [Note: averager state] in averaging/local_sgd.py
    chunks = {"outer/steps": Chunk(torch.tensor(state["steps"]))}
    for held, entries in zip(averager.tensors, state["tensors"], strict=True):
        piece = by_key[id(held)]
        for key, value in entries.items():
            flat = value.detach().reshape(-1)
            chunks[f"outer/{piece.name}/{key}"] = _piece_chunk(flat, piece)
    for name, tensor in state["local"].items():
        chunks[f"rank{rank}/outer/{name}"] = Chunk(tensor.detach())
    return chunks


def _buffers(model: nn.Module):
    params = {id(p) for p in model.parameters()}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in params:
            yield name, tensor


def check_same_model(model: nn.Module, saved: dict[str, list[int]]) -> None:
    """One error naming the first parameter or buffer where the checkpoint's model differs."""
    ours = model_shapes(model)
    for name, shape in ours.items():
        if name not in saved:
            raise ValueError(f"the checkpoint has no {name!r}; it was written for another model")
        if saved[name] != shape:
            raise ValueError(
                f"{name!r} has shape {saved[name]} in the checkpoint but {shape} in this model; "
                "resume with the same model"
            )
    for name in saved:
        if name not in ours:
            raise ValueError(
                f"the checkpoint's {name!r} is not in this model; it was written for another model"
            )


def load_state(
    folder,
    model,
    optimizer,
    averager=None,
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    prefix: str = "",
    local: bool = True,
) -> None:
    """Load the checkpoint `folder` into what this rank holds. Collective over `group`.

    local: also load this rank's own state (compression residuals, DiLoCo's outer residual);
        only meaningful when the checkpoint was written in the same layout (same ranks,
        strategy and mesh).
    """
    handle = handle_of(model)
    metadata = read_metadata(folder)
    stored = stored_tensors(folder, metadata)
    chunks, optimized = _held(model, optimizer, prefix)
    optim_state: dict[int, dict] = {}
    for piece in optimized.values():
        for key, size, dtype in _stored_under(stored, f"{prefix}optim/{piece.name}/"):
            target = chunks[f"{prefix}optim/{piece.name}/{key}"] = _target(size, dtype, piece)
            optim_state.setdefault(id(piece.key), {})[key] = target.tensor
    hook = handle.stateful_hook()
    hook_tensors: dict[str, torch.Tensor] = {}
    if hook is not None and local and f"rank{rank}/hook/rounds" in stored:
        for key, size, dtype in _stored_under(stored, f"rank{rank}/hook/"):
            hook_tensors[key] = torch.zeros(size, dtype=dtype)
            chunks[f"rank{rank}/hook/{key}"] = Chunk(hook_tensors[key])
    outer = _averager_targets(averager, optimized, stored, rank, local, chunks)
    for name, _ in _buffers(model):  # a checkpoint written before kept them apart
        if f"{prefix}model/{name}" not in stored and f"{prefix}buffer/{name}" in stored:
            chunks[f"{prefix}buffer/{name}"] = chunks.pop(f"{prefix}model/{name}")
    missing = sorted(k for k in chunks if k not in stored)
    if missing:
        raise ValueError(f"the checkpoint has no {missing[0]!r}; it was written by another setup")
    load_chunks(chunks, folder, group, metadata)
    _load_optimizer(optimizer, optim_state)
    if hook_tensors:
        rounds = int(hook_tensors.pop("rounds"))
        device = next(model.parameters()).device  # loaded on the CPU; kept where training is
        moved = {k: v.to(device) for k, v in hook_tensors.items()}
        hook.load_state_dict({"rounds": rounds}, moved)
    if outer is not None:
        steps, shared, local_state = outer
        device = averager.tensors[0].device if averager.tensors else "cpu"
        local_state = {k: v.to(device) for k, v in local_state.items()}
        averager.load_state_dict({"steps": int(steps), "tensors": shared, "local": local_state})
    handle.refresh()  # ZeRO-1/2 all-gather their loaded shards, ZeRO-3 regathers


def _target(size: torch.Size, dtype: torch.dtype, piece) -> Chunk:
    """Where a load puts a stored per-parameter entry of `piece`: a scalar whole, or the
    piece's run of an elementwise entry."""
    if len(size) == 0:
        return Chunk(torch.zeros((), dtype=dtype))
    if piece.whole and tuple(size) != (piece.value.numel(),):  # a whole one's other state
        return Chunk(torch.zeros(size, dtype=dtype, device=piece.value.device))
    blank = torch.zeros(piece.value.numel(), dtype=dtype, device=piece.value.device)
    return _piece_chunk(blank, piece)


def _stored_under(stored: dict, head: str):
    """(name after `head`, size, dtype) of every stored tensor whose name starts with `head`."""
    for name, (size, dtype) in stored.items():
        if name.startswith(head):
            yield name[len(head) :], size, dtype


def _averager_targets(averager, optimized, stored, rank, local, chunks):
    if averager is None:
        return None
    steps = torch.zeros((), dtype=torch.int64)
    chunks["outer/steps"] = Chunk(steps)
    shared = []
    for held in averager.tensors:
        piece = optimized[id(held)]
        entries = {}
        for key, size, dtype in _stored_under(stored, f"outer/{piece.name}/"):
            target = chunks[f"outer/{piece.name}/{key}"] = _target(size, dtype, piece)
            entries[key] = target.tensor
        shared.append(entries)
    local_state = {}
    if local:
        for key, size, dtype in _stored_under(stored, f"rank{rank}/outer/"):
            local_state[key] = torch.zeros(size, dtype=dtype)
            chunks[f"rank{rank}/outer/{key}"] = Chunk(local_state[key])
    return steps, shared, local_state


def _load_optimizer(optimizer, optim_state: dict[int, dict]) -> None:
    """Hand the loaded per-piece state to the optimizer in its own index order."""
    ours: dict = {"state": {}, "param_groups": []}
    index = 0
    for group in optimizer.param_groups:
        indices = []
        for param in group["params"]:
            entry = optim_state.get(id(param))
            if entry:
                shaped = {}
                for key, value in entry.items():
                    flat = value.dim() == 1 and value.numel() == param.numel()
                    shaped[key] = value.view_as(param) if flat else value
                ours["state"][index] = shaped
            indices.append(index)
            index += 1
        ours["param_groups"].append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": indices}
        )
    load_local_optimizer_state_dict(optimizer, ours)

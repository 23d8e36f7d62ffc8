"""ZeRO-3 state in plain form: whole weights, and optimizer state as if over model.parameters().

[Note: plain optimizer state] A checkpoint must move between strategies and world sizes, so
the optimizer state leaves the strategy as a plain optimizer over the original parameters
would write it: `{"state": {index: {...}}, "param_groups": [...]}`, with indices counted over
the param groups as the user passed them. A state entry shaped like its parameter (Adam's
moments, SGD's momentum) is elementwise: each rank holds the slices of its pieces, and one
all-gather per unit and key puts it back together. Anything else (`step`, None) is a scalar,
the same for every piece of a parameter, and is copied. Loading is the reverse and needs no
collective: every rank slices its pieces out of the whole entries.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from .fsdp_unit import FlatUnit


def _gather_flat(unit: FlatUnit, comm: Comm, local: torch.Tensor) -> torch.Tensor:
    """Every rank's `local` shard-sized tensor, concatenated (one all-gather)."""
    if comm.world_size == 1:
        return local.clone()
    out = torch.empty(unit.layout.padded_numel, dtype=local.dtype, device=local.device)
    comm.all_gather(out, local.contiguous())
    return out


def _locate(units: list[FlatUnit]) -> dict[int, tuple[FlatUnit, int]]:
    return {id(p): (u, i) for u in units for i, p in enumerate(u.params)}


def full_state_dict(model: nn.Module, units: list[FlatUnit], comm: Comm) -> dict:
    """The whole model on CPU with the plain model's keys, on every rank. Collective."""
    whole: dict[int, torch.Tensor] = {}
    for unit in units:
        if unit.empty:
            continue
        flat = _gather_flat(unit, comm, unit.shard.detach()).cpu()
        for p, off, shape in zip(unit.params, unit.layout.offsets, unit.shapes, strict=True):
            whole[id(p)] = flat[off : off + shape.numel()].view(shape).clone()
    return {
        name: whole[id(t)] if id(t) in whole else t.detach().cpu().clone()
        for name, t in model.state_dict(keep_vars=True).items()
    }


def load_full_state_dict(model: nn.Module, units: list[FlatUnit], comm: Comm, state: dict):
    """Write a whole-model state dict (present on every rank) into this rank's shards."""
    entries = model.state_dict(keep_vars=True)
    missing = sorted(set(entries) - set(state))
    unexpected = sorted(set(state) - set(entries))
    if missing or unexpected:
        raise ValueError(
            f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    name_of: dict[int, str] = {}
    for name, t in entries.items():
        name_of.setdefault(id(t), name)
    rank = comm.rank
    with torch.no_grad():
        for unit in units:
            unit.free()
            size = unit.layout.shard_numel
            flat = torch.zeros(unit.layout.padded_numel, dtype=unit.dtype, device=unit.device)
            for p, off, shape in zip(unit.params, unit.layout.offsets, unit.shapes, strict=True):
                value = state[name_of[id(p)]]
                if tuple(value.shape) != tuple(shape):
                    raise ValueError(
                        f"load_full_state_dict: '{name_of[id(p)]}' has shape "
                        f"{list(value.shape)}, the model's is {list(shape)}"
                    )
                flat[off : off + shape.numel()].copy_(value.reshape(-1))
            unit.shard.copy_(flat[rank * size : (rank + 1) * size])
        owned = {id(p) for u in units for p in u.params}
        for name, t in entries.items():
            if id(t) not in owned:
                t.copy_(state[name])


def _elementwise(key: str, value, param: nn.Parameter) -> bool:
    # A 0-d parameter's moments are 0-d like its `step`; tell them apart by name.
    return (
        torch.is_tensor(value)
        and tuple(value.shape) == tuple(param.shape)
        and (param.dim() > 0 or key != "step")
    )


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    originals: list[list[nn.Parameter]],
    units: list[FlatUnit],
    comm: Comm,
) -> dict:
    """The optimizer state as a plain optimizer over the original parameters would hold it
    ([Note: plain optimizer state]), on every rank. Collective."""
    where = _locate(units)
    params = [p for group in originals for p in group]
    local: dict[int, dict] = {}  # plain index -> key -> ("flat", dtype) or ("value", v)
    for index, p in enumerate(params):
        unit, position = where[id(p)]
        piece = unit.pieces[position]
        if piece is None or piece not in optimizer.state:
            continue
        entry = {}
        for key, v in optimizer.state[piece].items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == piece.shape:
                entry[key] = ("flat", v.dtype)
            else:
                entry[key] = ("value", v.detach().cpu().clone() if torch.is_tensor(v) else v)
        local[index] = entry
    described = comm.all_gather_object(local) if comm.world_size > 1 else [local]
    merged: dict[int, dict] = {}
    for rank_entries in described:
        for index, entry in rank_entries.items():
            for key, desc in entry.items():
                merged.setdefault(index, {}).setdefault(key, desc)
    state: dict[int, dict] = {index: {} for index in sorted(merged)}
    index_of = {id(p): i for i, p in enumerate(params)}
    for unit in units:
        keys: dict[str, torch.dtype] = {}
        for p in unit.params:
            for key, desc in merged.get(index_of.get(id(p), -1), {}).items():
                if desc[0] == "flat":
                    keys.setdefault(key, desc[1])
        for key, dtype in sorted(keys.items()):
            flat = torch.zeros(unit.layout.shard_numel, dtype=dtype, device=unit.device)
            for position, piece in enumerate(unit.pieces):
                value = optimizer.state.get(piece, {}).get(key) if piece is not None else None
                if value is not None:
                    start, stop, _ = unit.layout.local_slice(position, comm.rank)
                    flat[start:stop].copy_(value.reshape(-1))
            whole = _gather_flat(unit, comm, flat).cpu()
            for p, off, shape in zip(unit.params, unit.layout.offsets, unit.shapes, strict=True):
                index = index_of.get(id(p))
                if index in merged and merged[index].get(key, ("",))[0] == "flat":
                    state[index][key] = whole[off : off + shape.numel()].view(shape).clone()
    for index, entry in merged.items():
        for key, desc in entry.items():
            if desc[0] == "value":
                state[index][key] = desc[1]
    groups, start = [], 0
    for group, members in zip(optimizer.param_groups, originals, strict=True):
        plain = {k: v for k, v in group.items() if k != "params"}
        plain["params"] = list(range(start, start + len(members)))
        start += len(members)
        groups.append(plain)
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    originals: list[list[nn.Parameter]],
    units: list[FlatUnit],
    comm: Comm,
    plain: dict,
) -> None:
    """Load plain optimizer state (from any strategy or world size) into the shard pieces."""
    if len(plain["param_groups"]) != len(originals):
        raise ValueError(
            f"load_optimizer_state_dict: the state has {len(plain['param_groups'])} param "
            f"groups, this optimizer {len(originals)}"
        )
    where = _locate(units)
    piece_index = {
        id(q): i for i, q in enumerate(q for g in optimizer.param_groups for q in g["params"])
    }
    state: dict[int, dict] = {}
    params = [p for group in originals for p in group]
    for index, p in enumerate(params):
        entry = plain["state"].get(index, plain["state"].get(str(index)))
        unit, position = where[id(p)]
        piece = unit.pieces[position]
        if entry is None or piece is None or id(piece) not in piece_index:
            continue
        start, stop, inner = unit.layout.local_slice(position, comm.rank)
        mine = {}
        for key, value in entry.items():
            if _elementwise(key, value, p):
                mine[key] = value.reshape(-1)[inner : inner + stop - start].clone()
            else:
                mine[key] = value.clone() if torch.is_tensor(value) else value
        state[piece_index[id(piece)]] = mine
    groups = []
    for ours, theirs in zip(optimizer.param_groups, plain["param_groups"], strict=True):
        group = {k: v for k, v in theirs.items() if k != "params"}
        group["params"] = [piece_index[id(q)] for q in ours["params"]]
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})

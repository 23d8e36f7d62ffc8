"""Optimizer state in plain form, for every sharded strategy: as if over the model's parameters.

[Note: plain optimizer state] A checkpoint must move between strategies and world sizes, so the
optimizer state leaves a sharded strategy as a plain optimizer over the original parameters
would write it: `{"state": {index: {...}}, "param_groups": [...]}`, indices counted over the
param groups as the user passed them. One rule says what is elementwise: a tensor entry shaped
like what it belongs to (the piece when saving, the parameter when loading) whose key is not
one of the per-parameter scalars torch optimizers keep (`SCALAR_STATE_KEYS`: Adam's `step`,
NAdam's `mu_product`, ...). Elementwise entries are laid into each shard, all-gathered over the
shard group and cut back into parameters; every other entry is a scalar, the same for every
piece of a parameter, taken from the rank whose shard holds the parameter's first element.
Loading is the reverse and needs no collective: every rank slices its pieces out of the whole
entries. Replicas (2-D mesh) hold identical shards, so only the shard group takes part.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from .flat_shard import FlatShard

# State keys that torch optimizers keep as one number per parameter, not one per element.
SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})

# A sharded buffer as the converter sees it: the shard and the model parameters in its layout.
Sharded = tuple[FlatShard, list[nn.Parameter]]


def elementwise(key: str, value, like: torch.Tensor) -> bool:
    """The one rule ([Note: plain optimizer state])."""
    return torch.is_tensor(value) and value.shape == like.shape and key not in SCALAR_STATE_KEYS


def _describe(state: dict, piece: torch.Tensor) -> dict:
    """What a piece's state holds, small enough to all-gather as an object."""
    kinds, scalars = {}, {}
    for key, value in state.items():
        if elementwise(key, value, piece):
            kinds[key] = value.dtype
            continue
        if torch.is_tensor(value):
            if value.dim() > 0 and key not in SCALAR_STATE_KEYS:
                raise ValueError(
                    f"optimizer_state_dict: state {key!r} of shape {list(value.shape)} is not "
                    "elementwise; sharded checkpoints hold elementwise state only (docs/zero.md)"
                )
            value = value.detach().cpu().clone()
        scalars[key] = value
    return {"has_state": bool(state), "elementwise": kinds, "scalars": scalars}


def gather_plain_state(
    optimizer: torch.optim.Optimizer,
    sharded: list[Sharded],
    user_groups: list[list[nn.Parameter]],
    comm: Comm,
) -> dict:
    """The state_dict a plain optimizer over `user_groups` would return, on every rank of the
    shard group `comm`. Collective over it: every rank passes its shards in the same order."""
    plain_index = {id(p): i for i, p in enumerate(p for g in user_groups for p in g)}
    local = [
        [None if q is None else _describe(optimizer.state.get(q, {}), q) for q in shard.pieces]
        for shard, _ in sharded
    ]
    everyone = comm.all_gather_object(local) if comm.world_size > 1 else [local]
    state: dict[int, dict] = {}
    for k, (shard, params) in enumerate(sharded):
        layout = shard.layout
        infos = [everyone[rank][k] for rank in range(comm.world_size)]  # per rank, per param
        kinds = {key: d for per in infos for i in per if i for key, d in i["elementwise"].items()}
        full = {}
        for key, dtype in sorted(kinds.items()):
            part = torch.zeros(layout.shard_numel, dtype=dtype, device=shard.data.device)
            for piece, (start, stop) in zip(shard.pieces, shard.ranges, strict=True):
                value = optimizer.state.get(piece, {}).get(key) if piece is not None else None
                if torch.is_tensor(value) and value.shape == piece.shape:
                    part[start:stop].copy_(value)
            full[key] = torch.empty(layout.numel, dtype=dtype, device=part.device)
            if comm.world_size > 1:
                comm.all_gather(full[key], part)
            else:
                full[key].copy_(part)
        for position, (param, offset) in enumerate(zip(params, layout.offsets, strict=True)):
            info = infos[layout.owner(position)][position]
            if id(param) not in plain_index or info is None or not info["has_state"]:
                continue  # not optimized, never stepped, or no element anywhere
            entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in info["scalars"].items()}
            for key in info["elementwise"]:
                value = full[key][offset : offset + param.numel()]
                entry[key] = value.view_as(param).to("cpu", copy=True)
            state[plain_index[id(param)]] = entry
    groups = []
    for group, params in zip(optimizer.param_groups, user_groups, strict=True):
        plain = {k: v for k, v in group.items() if k != "params"}
        plain["params"] = [plain_index[id(p)] for p in params]
        groups.append(plain)
    return {"state": state, "param_groups": groups}


def load_plain_state(
    optimizer: torch.optim.Optimizer,
    sharded: list[Sharded],
    user_groups: list[list[nn.Parameter]],
    state: dict,
) -> None:
    """Load a plain optimizer's state_dict (from any strategy or world size) into the pieces:
    each takes its part of its parameter's elementwise entries, and copies of the scalars."""
    groups = state["param_groups"]
    sizes = [len(g) for g in user_groups]
    if [len(g["params"]) for g in groups] != sizes:
        raise ValueError(
            f"load_optimizer_state_dict: the state has param groups of sizes "
            f"{[len(g['params']) for g in groups]}, this optimizer {sizes}; build it with the "
            "same param groups"
        )
    entries = state["state"]
    saved = {
        id(param): entries.get(index, entries.get(str(index)))
        for group, params in zip(groups, user_groups, strict=True)
        for index, param in zip(group["params"], params, strict=True)
    }
    where = {}
    for shard, params in sharded:
        for position, (piece, param) in enumerate(zip(shard.pieces, params, strict=True)):
            if piece is not None:
                where[id(piece)] = (shard, position, param)
    ours: dict = {"state": {}, "param_groups": []}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        indices = []
        for piece in group["params"]:
            shard, position, param = where[id(piece)]
            entry = _piece_state(saved.get(id(param)), param, shard, position)
            if entry:
                ours["state"][index] = entry
            indices.append(index)
            index += 1
        ours["param_groups"].append(
            {**{k: v for k, v in groups[g].items() if k != "params"}, "params": indices}
        )
    optimizer.load_state_dict(ours)


def _piece_state(param_state: dict | None, param, shard: FlatShard, position: int) -> dict:
    """A piece's part of `param`'s state; scalars copied (a shared `step` tensor would be
    incremented once per piece)."""
    if not param_state:
        return {}
    start, stop, inner = shard.layout.local_slice(position, shard.rank)
    entry = {}
    for key, value in param_state.items():
        if elementwise(key, value, param):
            entry[key] = value.detach().reshape(-1)[inner : inner + stop - start].clone()
        else:
            entry[key] = value.clone() if torch.is_tensor(value) else value
    return entry

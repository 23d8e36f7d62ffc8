"""What a rank holds of the model: one description, every plain form derived from it.

[Note: geometry] Every strategy exports one `Geometry` (`Strategy.geometry`): for each
parameter of the plain model, the run of its flattened elements this rank holds, the tensor the
optimizer updates for that run (and keys its state by), and over which group the runs of one
parameter fit together:
- DDP: every parameter whole, the parameters themselves; no group (each rank holds it all);
- ZeRO-1/2/3: per parameter, its part inside this rank's flat shard ([Note: flat shard]): the
  piece the optimizer steps (fp32 masters in mixed precision); over the shard group the parts
  of one parameter are disjoint and cover it. A parameter with no element on this rank has no
  piece here. An owned parameter ([Note: optimizer layout] in optimizer_layout.py) is one whole piece
  (offset 0, `whole`) on its owner, its master, and nothing elsewhere. Parameters a sharded
  strategy keeps whole (ZeRO-1/2's frozen ones) are listed whole and marked `replicated`.
From it, and nowhere else, come the whole-model state dict (`full_state_dict`: every rank lays
its runs into zeros, one sum over the group, replicated runs counted once), loading one
(`load_full_state_dict`: each rank copies its runs out; no collective), the optimizer state in
plain per-parameter form (`optimizer_state_dict` and its load, [Note: plain optimizer state]),
the sharded checkpoints (checkpoint/state.py saves and loads exactly these runs) and the held
bytes of `memory_report`. After a load the strategy's `refresh_params` makes the model follow
(ZeRO-1/2 all-gather their shards again, ZeRO-3 gathers at the next forward). A parameter
under two names (tied weights) is held under the first name the model's state_dict gives it.
A tensor-parallel parameter ([Note: tensor-parallel parameters] in tensor_parallel.py) is its
local tensor here: runs, pieces and offsets are of the local tensor, and its plain forms are
made whole over "tp" after the runs are assembled over the group (`to_whole`), and cut back to
the local tensor before loading (`to_local`).

[Note: plain optimizer state] A checkpoint must move between strategies and world sizes, so the
optimizer state leaves as a plain optimizer over the original parameters would write it:
`{"state": {index: {...}}, "param_groups": [...]}`, indices counted over the param groups as
the user passed them. One rule says what is elementwise: a tensor entry shaped like what it
belongs to (the piece when saving, the parameter when loading) whose key is not one of the
per-parameter scalars torch optimizers keep (`SCALAR_STATE_KEYS`: Adam's `step`, ...).
Elementwise entries are assembled like the parameters; every other entry is a scalar, the same
for every piece of a parameter, taken from a rank that holds one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ...comm import Comm
from .tensor_parallel import spread_of, to_local, to_whole
from .torch_calls import is_carrier, load_local

# State keys that torch optimizers keep as one number per parameter, not one per element.
SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})
BATCH = 1 << 25  # elements summed per collective when assembling whole tensors


def elementwise(key: str, value, like: torch.Tensor) -> bool:
    """The one rule of [Note: plain optimizer state]."""
    return torch.is_tensor(value) and value.shape == like.shape and key not in SCALAR_STATE_KEYS


@dataclass(frozen=True)
class HeldPiece:
    """The run of one parameter's flattened elements that this rank holds.

    name: the parameter's name in the plain model's state_dict.
    param: the model's parameter.
    shape: the whole parameter's shape.
    offset: where `value` starts among the parameter's flattened elements.
    value: the elements, a 1-D view of what the optimizer updates (saved from, loaded into).
    key: the tensor the optimizer keys this piece's state by (None: not optimized).
    replicated: every rank of the group holds this same run (counted once when assembling).
    whole: an owned parameter's master ([Note: optimizer layout] in optimizer_layout.py): `value` is the
        whole parameter, held by this rank alone, and its optimizer state is the plain one
        (any shape), kept in the parameter's shape.
    """

    name: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    value: torch.Tensor
    key: torch.Tensor | None
    replicated: bool = False
    whole: bool = False


@dataclass(frozen=True)
class Geometry:
    """What this rank holds ([Note: geometry]).

    names: id(parameter) -> its first name in the model's state_dict, for every parameter.
    pieces: the runs this rank holds, at most one per parameter.
    group: the ranks whose runs of a parameter together cover it; None when every rank holds
        every parameter whole (DDP, or shard groups of one).
    dtypes: id(parameter) -> the dtype of the plain model's parameter (the masters' under
        mixed precision), what the whole-model state dict is returned in.
    """

    names: dict[int, str]
    pieces: tuple[HeldPiece, ...]
    group: Comm | None
    dtypes: dict[int, torch.dtype]

    def by_key(self) -> dict[int, HeldPiece]:
        """The optimized pieces by the id of the tensor the optimizer keys them by."""
        return {id(p.key): p for p in self.pieces if p.key is not None}


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in the model's state_dict."""
    names: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            names.setdefault(id(tensor), name)
    return names


def optimized_ids(optimizer: torch.optim.Optimizer | None) -> set[int]:
    """Ids of the tensors `optimizer` steps (none without one)."""
    if optimizer is None:
        return set()
    return {id(p) for group in optimizer.param_groups for p in group["params"] if not is_carrier(p)}


def build_geometry(
    model: nn.Module,
    sharded: list,
    group: Comm | None,
    optimized: set[int],
    dtypes: dict[int, torch.dtype] | None = None,
    owned: dict[int, nn.Parameter | None] | None = None,
) -> Geometry:
    """The geometry of a model whose `sharded` (FlatShard, its parameters) pairs this rank
    holds a shard of, every other parameter whole; `optimized`: ids of the tensors the
    optimizer steps (pieces or parameters); `owned`: id(parameter) -> its whole master on this
    rank, or None where another rank of the group owns it ([Note: optimizer layout])."""
    names = parameter_names(model)
    owned = owned or {}
    pieces, covered = [], set()
    for shard, params in sharded:
        for position, (piece, param) in enumerate(zip(shard.pieces, params, strict=True)):
            covered.add(id(param))
            if id(param) in owned:
                master = owned[id(param)]
                if master is not None:
                    key = master if id(master) in optimized else None
                    value = master.detach().view(-1)
                    held = HeldPiece(names[id(param)], param, param.shape, 0, value, key)
                    pieces.append(replace(held, whole=True))
                continue
            if piece is None:
                continue
            inner = shard.starts[position]
            key = piece if piece.requires_grad and id(piece) in optimized else None
            pieces.append(
                HeldPiece(names[id(param)], param, param.shape, inner, piece.detach(), key)
            )
    shared = group is not None and group.world_size > 1
    for p in model.parameters():  # each parameter once, tied ones too
        if id(p) not in covered:
            key = p if id(p) in optimized else None
            value = p.detach().view(-1)
            # A whole parameter (not a tensor-parallel slice) keeps any optimizer state whole,
            # Adafactor's factors too, as an owner's master does ([Note: optimizer layout]).
            whole = not spread_of(p)
            pieces.append(
                HeldPiece(names[id(p)], p, p.shape, 0, value, key, replicated=shared, whole=whole)
            )
    plain = {id(p): (dtypes or {}).get(id(p), p.dtype) for p in model.parameters()}
    return Geometry(names, tuple(pieces), group if shared else None, plain)


def _assemble(entries: list[tuple[torch.Size, torch.dtype, list]], group: Comm | None) -> list:
    """Whole tensors from runs: entries of (shape, dtype, [(offset, value, replicated)]), each
    rank giving its runs; a sum over `group` in batches (runs are disjoint across its ranks,
    replicated ones are given by its rank 0 only). Collective when `group` is set."""
    out: list[torch.Tensor | None] = [None] * len(entries)
    dtypes = sorted({str(dtype) for _, dtype, _ in entries})
    for dtype_name in dtypes:
        chosen = [i for i, (_, dtype, _) in enumerate(entries) if str(dtype) == dtype_name]
        while chosen:
            batch, total = [], 0
            while chosen and (not batch or total + entries[chosen[0]][0].numel() <= BATCH):
                batch.append(chosen.pop(0))
                total += entries[batch[-1]][0].numel()
            _assemble_batch(entries, batch, total, group, out)
    return out


def _assemble_batch(entries, batch: list[int], total: int, group: Comm | None, out: list) -> None:
    dtype = entries[batch[0]][1]
    device = next((v.device for i in batch for _, v, _ in entries[i][2]), torch.device("cpu"))
    flat = torch.zeros(total, dtype=dtype, device=device)
    start = 0
    lead = group is None or group.rank == 0
    for i in batch:
        shape, _, runs = entries[i]
        for offset, value, replicated in runs:
            if replicated and not lead:
                continue
            flat[start + offset : start + offset + value.numel()].copy_(value.reshape(-1))
        start += shape.numel()
    if group is not None:
        group.all_reduce(flat)
    flat = flat.cpu()
    start = 0
    for i in batch:
        shape = entries[i][0]
        out[i] = flat[start : start + shape.numel()].view(shape).clone()
        start += shape.numel()


def full_state_dict(model: nn.Module, geometry: Geometry) -> dict[str, torch.Tensor]:
    """The whole model on CPU with the plain model's keys, on every rank. Collective over the
    geometry's group."""
    params = {id(p): p for p in model.parameters()}
    order = list(geometry.names)  # every rank lists every parameter, in one order
    runs: dict[int, list] = {i: [] for i in order}
    for piece in geometry.pieces:
        runs[id(piece.param)].append((piece.offset, piece.value, piece.replicated))
    entries = [(params[i].shape, geometry.dtypes[i], runs[i]) for i in order]
    assembled = _assemble(entries, geometry.group)
    whole = {i: to_whole(params[i], t) for i, t in zip(order, assembled, strict=True)}
    return {
        name: whole[id(t)] if id(t) in whole else t.detach().cpu().clone()
        for name, t in model.state_dict(keep_vars=True).items()
    }


@torch.no_grad()
def load_full_state_dict(model: nn.Module, geometry: Geometry, state: dict) -> None:
    """Write a whole-model state dict (present on every rank) into what this rank holds and
    into the buffers; no collective (the strategy then calls `refresh_params`)."""
    entries = model.state_dict(keep_vars=True)
    state = {
        name: to_local(entries[name], t) if name in entries else t for name, t in state.items()
    }
    missing = sorted(set(entries) - set(state))
    unexpected = sorted(set(state) - set(entries))
    if missing or unexpected:
        raise ValueError(
            f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    for name, t in entries.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(
                f"load_full_state_dict: '{name}' has shape {list(state[name].shape)}, the "
                f"model's is {list(t.shape)}"
            )
    for piece in geometry.pieces:
        whole = state[piece.name].reshape(-1)
        piece.value.copy_(whole[piece.offset : piece.offset + piece.value.numel()])
    for name, t in entries.items():
        if id(t) not in geometry.names:
            t.copy_(state[name])


def _describe(state: dict, piece: torch.Tensor, whole: bool = False) -> dict:
    """What a piece's state holds, small enough to all-gather as an object (a whole piece's
    other tensors, Adafactor's row and column factors, go whole)."""
    kinds, scalars = {}, {}
    for key, value in state.items():
        if elementwise(key, value, piece):
            kinds[key] = value.dtype
            continue
        if torch.is_tensor(value):
            if value.dim() > 0 and key not in SCALAR_STATE_KEYS and not whole:
                raise ValueError(
                    f"optimizer_state_dict: state {key!r} of shape {list(value.shape)} is not "
                    "elementwise; sharded checkpoints hold elementwise state only (docs/zero.md)"
                )
            value = value.detach().cpu().clone()
        scalars[key] = value
    return {"has_state": bool(state), "elementwise": kinds, "scalars": scalars}


def optimizer_state_dict(
    geometry: Geometry, optimizer: torch.optim.Optimizer, user_groups: list[list[nn.Parameter]]
) -> dict:
    """The state_dict a plain optimizer over `user_groups` would return, on every rank.
    Collective over the geometry's group."""
    plain_index = {id(p): i for i, p in enumerate(p for g in user_groups for p in g)}
    order = [i for i in geometry.names if i in plain_index]
    held = {id(p.param): p for p in geometry.pieces if p.key is not None}
    local = {
        geometry.names[i]: _describe(
            optimizer.state.get(held[i].key, {}), held[i].key, held[i].whole
        )
        for i in order
        if i in held
    }
    group = geometry.group
    everyone = group.all_gather_object(local) if group is not None else [local]
    params = {id(p): p for g in user_groups for p in g}
    entries, slots, state = [], [], {}
    for i in order:
        infos = [d[geometry.names[i]] for d in everyone if geometry.names[i] in d]
        info = next((d for d in infos if d["has_state"]), None)
        if info is None:
            continue  # not optimized, or never stepped
        entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in info["scalars"].items()}
        state[plain_index[i]] = entry
        kinds = {key: dtype for d in infos for key, dtype in d["elementwise"].items()}
        for key, dtype in sorted(kinds.items()):
            piece = held.get(i)
            value = optimizer.state.get(piece.key, {}).get(key) if piece is not None else None
            runs = [] if value is None else [(piece.offset, value, piece.replicated)]
            entries.append((params[i].shape, dtype, runs))
            slots.append((entry, key, params[i]))
    for (entry, key, param), whole in zip(slots, _assemble(entries, group), strict=True):
        entry[key] = to_whole(param, whole)
    groups = []
    for group_state, params_of in zip(optimizer.param_groups, user_groups, strict=True):
        plain = {k: v for k, v in group_state.items() if k != "params"}
        plain["params"] = [plain_index[id(p)] for p in params_of]
        groups.append(plain)
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    geometry: Geometry,
    optimizer: torch.optim.Optimizer,
    user_groups: list[list[nn.Parameter]],
    state: dict,
) -> None:
    """Load a plain optimizer's state_dict (from any strategy or world size): each piece
    takes its run of its parameter's elementwise entries, and copies of the scalars."""
    load_local(optimizer, local_optimizer_state(geometry, optimizer, user_groups, state))


def local_optimizer_state(
    geometry: Geometry,
    optimizer: torch.optim.Optimizer,
    user_groups: list[list[nn.Parameter]],
    state: dict,
) -> dict:
    """This rank's state_dict for `optimizer` from a plain one ([Note: plain optimizer
    state]): no collective. A state that is not plain over `user_groups` raises ValueError
    naming what differs (the group sizes, an entry shaped unlike its parameter)."""
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
    pieces = geometry.by_key()
    ours: dict = {"state": {}, "param_groups": []}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        indices = []
        for key in group["params"]:
            if not is_carrier(key):  # [Note: torch's own calls]: it has no state
                piece = pieces[id(key)]
                entry = _piece_state(saved.get(id(piece.param)), piece)
                if entry:
                    ours["state"][index] = entry
            indices.append(index)
            index += 1
        ours["param_groups"].append(
            {**{k: v for k, v in groups[g].items() if k != "params"}, "params": indices}
        )
    return ours


def _piece_state(param_state: dict | None, piece: HeldPiece) -> dict:
    """A piece's run of its parameter's state; scalars copied (a shared `step` tensor would be
    incremented once per piece). An entry that is neither shaped like the parameter nor a
    scalar, where the piece is not whole, is not plain state (a rank's shard): ValueError."""
    if not param_state:
        return {}
    stop = piece.offset + piece.value.numel()
    entry = {}
    for key, value in param_state.items():
        value = to_local(piece.param, value) if torch.is_tensor(value) else value
        if piece.whole and torch.is_tensor(value):  # the plain state, in its own shape
            entry[key] = value.detach().clone()
        elif elementwise(key, value, piece.param):
            entry[key] = value.detach().reshape(-1)[piece.offset : stop].clone()
        elif torch.is_tensor(value) and value.numel() > 1:
            raise ValueError(
                f"state {key!r} of '{piece.name}' has shape {list(value.shape)}, the "
                f"parameter {list(piece.param.shape)}"
            )
        else:
            entry[key] = value.clone() if torch.is_tensor(value) else value
    return entry

"""ZeRO-3 weights in plain form: the whole model's state dict, and loading one into the shards.

The optimizer state's plain form is every sharded strategy's ([Note: plain optimizer state] in
parts/plain_state.py).
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
    out = torch.empty(unit.layout.numel, dtype=local.dtype, device=local.device)
    comm.all_gather(out, local.contiguous())
    return out


def full_state_dict(model: nn.Module, units: list[FlatUnit], comm: Comm) -> dict:
    """The whole model on CPU with the plain model's keys, on every rank. Collective."""
    whole: dict[int, torch.Tensor] = {}
    for unit in units:
        if unit.empty:
            continue
        flat = _gather_flat(unit, comm, unit.shard.data.detach()).cpu()
        for p, off, shape in zip(unit.params, unit.layout.offsets, unit.shapes, strict=True):
            whole[id(p)] = flat[off : off + shape.numel()].view(shape).clone()
    return {
        name: whole[id(t)] if id(t) in whole else t.detach().cpu().clone()
        for name, t in model.state_dict(keep_vars=True).items()
    }


def load_full_state_dict(model: nn.Module, units: list[FlatUnit], state: dict):
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
    with torch.no_grad():
        for unit in units:
            unit.free()
            start, stop = unit.layout.shard_range(unit.shard.rank)
            flat = torch.zeros(unit.layout.numel, dtype=unit.dtype, device=unit.device)
            for p, off, shape in zip(unit.params, unit.layout.offsets, unit.shapes, strict=True):
                value = state[name_of[id(p)]]
                if tuple(value.shape) != tuple(shape):
                    raise ValueError(
                        f"load_full_state_dict: '{name_of[id(p)]}' has shape "
                        f"{list(value.shape)}, the model's is {list(shape)}"
                    )
                flat[off : off + shape.numel()].copy_(value.reshape(-1))
            unit.shard.data.copy_(flat[start:stop])
        owned = {id(p) for u in units for p in u.params}
        for name, t in entries.items():
            if id(t) not in owned:
                t.copy_(state[name])

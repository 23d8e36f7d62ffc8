"""What a rank holds of the model, named as in the plain model: the pieces a sharded checkpoint
saves and loads ([Note: chunks] in checkpoint/dcp.py).

[Note: held pieces] Every strategy can say, for each parameter of the plain model, which run of
its flattened elements this rank holds and which tensor the optimizer keys its state by:
- DDP holds every parameter whole, and the optimizer steps the parameters themselves;
- ZeRO-1/2/3 hold, per parameter, its part inside this rank's flat shard ([Note: flat shard]):
  the piece the optimizer steps, fp32 masters in mixed precision. A parameter with no element
  in this rank's shard is not listed.
Saving writes each piece where it belongs in the flattened parameter; loading writes into the
same pieces, after which `Strategy.refresh_params` makes the model's parameters follow
(ZeRO-1/2 all-gather their shards again, ZeRO-3 gathers them at the next forward). A parameter
under two names (tied weights) is listed under the first name the model's state_dict gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .flat_shard import FlatShard


@dataclass(frozen=True)
class HeldPiece:
    """The run of one parameter's flattened elements that this rank holds.

    name: the parameter's name in the plain model's state_dict.
    shape: the whole parameter's shape.
    offset: where `value` starts among the parameter's flattened elements.
    value: the elements, a 1-D view of what the optimizer updates (saved from, loaded into).
    key: the tensor the optimizer keys this piece's state by (None: not optimized).
    """

    name: str
    shape: torch.Size
    offset: int
    value: torch.Tensor
    key: torch.Tensor | None


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in the model's state_dict."""
    names: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            names.setdefault(id(tensor), name)
    return names


def whole_pieces(
    model: nn.Module, names: dict[int, str], optimized: set[int], skip: set[int]
) -> list[HeldPiece]:
    """Every parameter not in `skip`, whole (DDP's case and the rest of a sharded model);
    `names` from `parameter_names`."""
    out = []
    for p in model.parameters():  # each parameter once, tied ones too
        if id(p) in skip:
            continue
        key = p if id(p) in optimized else None
        out.append(HeldPiece(names[id(p)], p.shape, 0, p.detach().view(-1), key))
    return out


def shard_pieces(names: dict[int, str], sharded: list[tuple[FlatShard, list[nn.Parameter]]]):
    """The pieces of the flat shards, named by `names` (`parameter_names`); and the ids of
    the parameters they cover."""
    out, covered = [], set()
    for shard, params in sharded:
        for position, (piece, param) in enumerate(zip(shard.pieces, params, strict=True)):
            covered.add(id(param))
            if piece is None:
                continue
            _, _, inner = shard.layout.local_slice(position, shard.rank)
            key = piece if piece.requires_grad else None
            out.append(HeldPiece(names[id(param)], param.shape, inner, piece.detach(), key))
    return out, covered


def optimized_ids(optimizer: torch.optim.Optimizer | None) -> set[int]:
    if optimizer is None:
        return set()
    return {id(p) for group in optimizer.param_groups for p in group["params"]}

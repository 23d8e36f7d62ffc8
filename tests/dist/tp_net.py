"""A small residual net split over "tp" with PyTorch's ColwiseParallel / RowwiseParallel, its
data, and the net on dp x tp ranks under a strategy (test_tp.py, test_checkpoint_shapes.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dataparallel as dp

ADAMW = {"lr": 1e-3, "weight_decay": 0.1}


class Block(nn.Module):
    """A residual MLP block with biases: `up` is split by columns (its bias Shard(0)), `down` by
    rows (its bias Replicate), so both kinds of placement are trained."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def plan(name: str, model: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    up, down = ("up", "down") if name == "net" else ("mlp.0", "mlp.2")
    out = {}
    for i in range(len(model.blocks)):
        out[f"blocks.{i}.{up}"] = ColwiseParallel()
        out[f"blocks.{i}.{down}"] = RowwiseParallel()
    return out


def batch(name: str, step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    if name == "net":
        return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
    x = torch.randint(0, 32, (size, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def layout(world, dp_size: int, tp_size: int, strategy: str, seed_shift: int = 0):
    """The net on dp_size x tp_size ranks under `strategy` (tp 1: the plain model)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_size == 1:
        torch.manual_seed(7 + seed_shift)
        model = dp.parallelize(Net(), strategy)
    else:
        mesh = init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(7 + seed_shift)
        model = Net()
        parallelize_module_(model, mesh)
        model = dp.parallelize(model, strategy, mesh=mesh["dp"])
    return model, dp.build_optimizer(model, torch.optim.AdamW, **ADAMW)


def parallelize_module_(model, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], plan("net", model))

"""A small model with odd sizes (shards split its parameters), a tied matrix and a buffer, under
every strategy by name, and its weights and optimizer state in plain form: what the checkpoint
tests save and load (test_resharding.py, test_checkpoint_shapes.py)."""

from __future__ import annotations

import torch
from torch import nn

import dataparallel as dp


class Tied(nn.Module):
    """Odd sizes (shards split parameters), a tied matrix and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 37)
        self.mid = nn.Linear(37, 37)
        self.out = nn.Linear(37, 16)
        self.back = nn.Linear(16, 8, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.embed(x))))
        return self.back(torch.tanh(self.out(h))) * self.scale


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Tied()


def parallelize(model, name: str):
    strategy, _, mesh = name.partition("@")
    small = {"bucket_mb": 0.002, "first_bucket_mb": 0.001} if strategy != "zero3" else {}
    policy = {"ddp": dp.DDP, "zero1": dp.ZeRO1, "zero2": dp.ZeRO2, "zero3": dp.ZeRO3}[strategy]
    dp.parallelize(model, policy(**small), mesh=dp.init_mesh(2) if mesh else None)
    return dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def plain(model, optimizer) -> tuple[dict, dict]:
    return dp.full_state_dict(model), dp.optimizer_state_dict(model, optimizer)["state"]

"""A small regression for the multi-rank tests of compression, averaging and checkpoints: an
MLP and the deterministic data it learns (a fixed smooth function of the inputs)."""

from __future__ import annotations

import torch
from torch import nn


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def data(step: int, rank: int, per_rank: int = 8):
    g = torch.Generator().manual_seed(7 * step + 1000 * rank)
    x = torch.randn(per_rank, 16, generator=g)
    target = torch.sin(x[:, :8] * 2) + 0.5 * x[:, 8:]  # a fixed smooth function to learn
    return x, target

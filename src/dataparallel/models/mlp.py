"""A plain MLP over token embeddings of a fixed window: the simplest reference model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """vocab_size: token ids; block_size: window length; n_embd: embedding width;
    hidden: hidden width; n_layer: hidden layers."""

    vocab_size: int = 256
    block_size: int = 64
    n_embd: int = 64
    hidden: int = 512
    n_layer: int = 2


class MLP(nn.Module):
    """Predicts every next token from its embedding alone (a bigram-ish baseline)."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = [nn.Embedding(config.vocab_size, config.n_embd)]
        width = config.n_embd
        for _ in range(config.n_layer):
            layers += [nn.Linear(width, config.hidden), nn.GELU()]
            width = config.hidden
        layers.append(nn.Linear(width, config.vocab_size))
        self.net = nn.Sequential(*layers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

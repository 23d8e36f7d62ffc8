"""The Muon + AdamW recipe the Muon and MuLoCo tests share: Muon on the blocks' matrices,
AdamW on the rest, and the strategies with small buckets (several per model)."""

from __future__ import annotations

import torch
from torch import nn

import dataparallel as dp

SMALL = {"bucket_mb": 0.02, "first_bucket_mb": 0.002}
MUON = {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"}
ADAMW = {"lr": 3e-3, "weight_decay": 0.1}
POLICIES = {
    "ddp": lambda: dp.DDP(**SMALL),
    "zero1": lambda: dp.ZeRO1(**SMALL),
    "zero2": lambda: dp.ZeRO2(**SMALL),
    "zero3": lambda: dp.ZeRO3(),
}


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """Muon's share of the usual recipe: the blocks' 2-D weights (not embeddings, not head)."""
    return p.dim() == 2 and name.startswith("blocks.")


def recipe(model: nn.Module) -> list[dict]:
    """One call's param groups: Muon on the hidden matrices, AdamW on the rest."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if is_hidden_matrix(n, p)]},
        {
            "params": [p for n, p in named if not is_hidden_matrix(n, p)],
            "optimizer": torch.optim.AdamW,
            **ADAMW,
        },
    ]

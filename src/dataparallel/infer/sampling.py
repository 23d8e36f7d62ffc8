"""Sampling text from trained weights (`dataparallel sample`), with plain torch and safetensors.

The weights file carries its model's name and config in its safetensors metadata, so the model
is rebuilt from the file alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from ..checkpoint import read_weights_metadata
from ..models import MODEL_CONFIGS, build_model


def weights_path(path: str | Path) -> Path:
    """The weights of a run directory (its model.safetensors) or a .safetensors file itself."""
    path = Path(path)
    return path / "model.safetensors" if path.is_dir() else path


def load_trained_model(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode, metadata) from a run directory or a weights file."""
    file = weights_path(path)
    metadata = read_weights_metadata(file)
    if metadata.get("model") not in MODEL_CONFIGS:
        raise ValueError(
            f"{file} holds no reference model (model={metadata.get('model')!r}); load your own "
            "model with safetensors.torch.load_file and sample from it in Python"
        )
    model = build_model(metadata["model"], **metadata.get("model_config", {}))
    model.load_state_dict(load_file(str(file)))
    return model.eval(), metadata


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: bytes,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    block_size: int,
) -> bytes:
    """Continue `prompt` byte by byte; any model mapping (batch, time) ids to logits works."""
    idx = torch.tensor([list(prompt or b"\n")], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float() / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
        idx = torch.cat([idx, next_id], dim=1)
    return bytes(idx[0].tolist())

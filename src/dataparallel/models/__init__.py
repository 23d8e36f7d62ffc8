"""Reference models for the CLI, tests and benchmarks, built by name."""

from __future__ import annotations

from torch import nn

from .gpt import GPT, GPTConfig
from .mlp import MLP, MLPConfig

# name -> config; the CLI's --model picks one. Sizes are for the byte vocabulary (256).
MODEL_CONFIGS = {
    "gpt-tiny": GPTConfig(n_layer=4, n_head=4, n_embd=144, block_size=128),  # ~1.0M
    "gpt-small": GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256),  # ~3.3M
    "gpt-medium": GPTConfig(n_layer=10, n_head=8, n_embd=512, block_size=256),  # ~31.8M
    "mlp": MLPConfig(),
}


def build_model(name: str, **overrides) -> nn.Module:
    """A fresh model by name; `overrides` replace config fields (e.g. block_size=64)."""
    if name not in MODEL_CONFIGS:
        known = ", ".join(sorted(MODEL_CONFIGS))
        raise ValueError(f"model: unknown model {name!r}; choose one of {known}")
    config = MODEL_CONFIGS[name]
    if overrides:
        config = type(config)(**{**config.__dict__, **overrides})
    return GPT(config) if isinstance(config, GPTConfig) else MLP(config)


__all__ = ["GPT", "MLP", "MODEL_CONFIGS", "GPTConfig", "MLPConfig", "build_model"]

"""Checkpoint files: safetensors weights and the training state, written atomically."""

from .store import (
    atomic_write_bytes,
    latest_checkpoint,
    load_checkpoint,
    read_weights_metadata,
    save_checkpoint,
    save_weights,
)

__all__ = [
    "atomic_write_bytes",
    "latest_checkpoint",
    "load_checkpoint",
    "read_weights_metadata",
    "save_checkpoint",
    "save_weights",
]

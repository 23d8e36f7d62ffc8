"""Sharded checkpoints: each rank saves and loads only what it holds, through
torch.distributed.checkpoint, in folders committed atomically; and the exported weights."""

from .dcp import Chunk, load_chunks, read_metadata, save_chunks, stored_tensors
from .folders import (
    CheckpointError,
    atomic_write_bytes,
    begin,
    commit,
    complete_checkpoints,
    latest_checkpoint,
    read_train_state,
    read_weights_metadata,
    step_name,
    verify,
    write_safetensors,
)
from .state import check_same_model, load_state, model_shapes, state_chunks

__all__ = [
    "CheckpointError",
    "Chunk",
    "atomic_write_bytes",
    "begin",
    "check_same_model",
    "commit",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_chunks",
    "load_state",
    "model_shapes",
    "read_metadata",
    "read_train_state",
    "read_weights_metadata",
    "save_chunks",
    "state_chunks",
    "step_name",
    "stored_tensors",
    "verify",
    "write_safetensors",
]

"""Checkpoints of a training run: what is saved for --resume, and how it is put back.

Saved (see checkpoint/store.py for the files): the full model weights, the optimizer state in
plain single-process form, the sampler's position (epoch and index within this rank's shard)
and the step. The learning rate is a pure function of the step (train/schedule.py), so
restoring the step restores the schedule. No random state needs saving: the reference models
have no dropout, and the data order depends only on the seed, epoch and position.

Saving is collective (sharded strategies gather weights and optimizer state on every rank);
rank 0 writes. Loading: rank 0 reads the files and broadcasts them, so the other machines of a
multi-node run need no shared file system.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

import dataparallel as dp

from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_weights
from .trainer import Callback, StepRecord, TrainState

CHECKPOINTS = "checkpoint"
FINAL_WEIGHTS = "model.safetensors"


def weights_metadata(state: TrainState) -> dict:
    """What `dataparallel sample` (or anyone) needs to rebuild the model from the weights."""
    model_config = getattr(state.model, "config", None)
    is_config = dataclasses.is_dataclass(model_config) and not isinstance(model_config, type)
    return {
        "model": state.model_name,
        "model_config": dataclasses.asdict(model_config) if is_config else {},
        "corpus_sha256": state.corpus.sha256,
        "step": state.step,
    }


def save_run_checkpoint(state: TrainState, run_dir: Path) -> None:
    """Save a resumable checkpoint of `state` under run_dir/checkpoint. Collective."""
    weights = dp.full_state_dict(state.model)
    optimizer = dp.optimizer_state_dict(state.model, state.optimizer)
    if state.world.is_main:
        train_state = {
            "optimizer": optimizer,
            "sampler": state.sampler.state_dict(),
            "world_size": state.world.world_size,
            "corpus_sha256": state.corpus.sha256,
        }
        if state.scaler is not None:  # --precision fp16: the loss scale and its growth count
            train_state["scaler"] = state.scaler.state_dict()
        save_checkpoint(
            Path(run_dir) / CHECKPOINTS, state.step, weights, weights_metadata(state), train_state
        )
    if state.world.world_size > 1:
        dist.barrier(group=state.world.group)  # nobody runs ahead of a checkpoint being written


def save_final_weights(state: TrainState, run_dir: Path) -> Path:
    """The trained weights as run_dir/model.safetensors (rank 0 writes). Collective."""
    weights = dp.full_state_dict(state.model)
    path = Path(run_dir) / FINAL_WEIGHTS
    if state.world.is_main:
        save_weights(path, weights, weights_metadata(state))
    return path


def restore(state: TrainState, run_dir: Path) -> None:
    """Continue from the newest checkpoint under run_dir (every rank calls it)."""
    payload: list = [None]
    if state.world.is_main:
        folder = latest_checkpoint(Path(run_dir) / CHECKPOINTS)
        if folder is None:
            raise FileNotFoundError(f"{run_dir} has no complete checkpoint to resume from")
        payload = [load_checkpoint(folder)]
    if state.world.world_size > 1:
        dist.broadcast_object_list(payload, src=0, group=state.world.group)
    weights, train_state = payload[0]
    if train_state["world_size"] != state.world.world_size:
        raise ValueError(
            f"the checkpoint was written by {train_state['world_size']} ranks, this run has "
            f"{state.world.world_size}; resume with the same number of workers"
        )
    dp.load_full_state_dict(state.model, weights)
    dp.load_optimizer_state_dict(state.model, state.optimizer, train_state["optimizer"])
    state.sampler.load_state_dict(train_state["sampler"])
    if state.scaler is not None and "scaler" in train_state:
        state.scaler.load_state_dict(train_state["scaler"])
    state.step = int(train_state["step"])


class CheckpointSaver(Callback):
    """Saves a resumable checkpoint every `every` steps and at the end (on every rank).

    run_dir: the run directory.
    every: steps between checkpoints; 0 saves only at the end.
    """

    def __init__(self, run_dir: Path, every: int):
        self.run_dir = Path(run_dir)
        self.every = every

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        if self.every and record.step % self.every == 0 and record.step != state.last_step:
            save_run_checkpoint(state, self.run_dir)

    def on_end(self, state: TrainState) -> None:
        save_run_checkpoint(state, self.run_dir)
        save_final_weights(state, self.run_dir)

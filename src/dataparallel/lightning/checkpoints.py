"""Lightning's checkpoints on the engine: one file, or a sharded folder.

[Note: Lightning's checkpoints] `trainer.save_checkpoint(path)` (and `ModelCheckpoint`) hands
the strategy Lightning's checkpoint dict on every rank; what is written depends on what the
ranks hold:
- one file, written by rank 0 whole (written aside, then renamed: a save killed half-way
  leaves the previous file): when every rank holds the same state (DDP without an averager),
  and for `weights_only=True` on every strategy. Its "state_dict" is the LightningModule's
  own keys, whole (`dp.full_state_dict`), its "optimizer_states" the portable form
  (`dp.optimizer_state_dict`): `LightningModule.load_from_checkpoint` and a plain torch
  optimizer read it, and any strategy of ours resumes from it.
- a folder under the same name (as Lightning's FSDP strategy writes with
  `state_dict_type="sharded"`): under ZeRO-1/2/3, and whenever an averager keeps one model
  per replica. Every rank writes what it holds, through torch.distributed.checkpoint
  (`dp.checkpoint.state_chunks`, resharded on load to any world and strategy), and rank 0
  the rest of Lightning's dict (loops, schedulers, callbacks) as `meta.pt`; the folder is
  written as NAME.tmp and renamed when complete.
`ckpt_path=` takes either: a folder loads each rank's part in `load_checkpoint` (after the
optimizers are built: `restore_checkpoint_after_setup`), a file through the model's and the
optimizers' state dicts.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import dataparallel as dp
from dataparallel.checkpoint import atomic_write_bytes, load_state, save_chunks, state_chunks

META = "meta.pt"
PREFIX = "module."  # the LightningModule's place in the parallelized wrapper (strategy.py)


def module_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LightningModule's whole state dict, its own keys (collective under ZeRO-3)."""
    return {k.removeprefix(PREFIX): v for k, v in dp.full_state_dict(model).items()}


def load_module_state(model: nn.Module, state: dict, strict: bool) -> None:
    """Load a LightningModule's whole state dict into the parallelized wrapper."""
    expected = set(module_state_keys(model))
    if strict and set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise KeyError(
            f"checkpoint state_dict: missing {missing[:3]}, unexpected {unexpected[:3]}; "
            "it was written for another model (or load it with strict=False)"
        )
    known = {PREFIX + k: v for k, v in state.items() if k in expected}
    if not strict:
        whole = {PREFIX + k: v for k, v in module_state(model).items()}
        known = {**whole, **known}
    dp.load_full_state_dict(model, known)


def module_state_keys(model: nn.Module) -> list[str]:
    return [k.removeprefix(PREFIX) for k in model.state_dict(keep_vars=True)]


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's values (lr, betas, ...) without its tensors: what a sharded folder
    keeps beside the tensors (a scheduler sets lr at its next step, not before the first)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def load_hyper_parameters(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"ckpt_path: the checkpoint's optimizer has {len(groups)} param groups, this one "
            f"{len(optimizer.param_groups)}; resume with the same configure_optimizers"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)


def write_file(checkpoint: dict, path: Path) -> None:
    """One file, replaced at once (rank 0 only)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())


def write_folder(checkpoint: dict, path: Path, model, optimizer, averager, rank, prefix, layout):
    """The sharded folder (collective over every rank)."""
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()  # the folder exists before anyone writes into it
    chunks = state_chunks(model, optimizer, averager, rank=rank, prefix=prefix)
    save_chunks(chunks, tmp, dist.group.WORLD)
    if rank == 0:
        meta = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        torch.save({**meta, "dataparallel_layout": layout}, tmp / META)
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old) if path.is_dir() else path.unlink()
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # the folder is complete for every rank


def read_folder(path: Path, model, optimizer, averager, rank, prefix, layout) -> dict:
    """Load this rank's part of the sharded folder; Lightning's dict without the tensors."""
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    saved = meta.pop("dataparallel_layout", None) or {}
    if saved.get("replicas", 1) != layout["replicas"]:
        raise ValueError(
            f"ckpt_path: {path} holds {saved.get('replicas', 1)} replicas (local_sgd/diloco), "
            f"this run has {layout['replicas']}; resume with the same number of replicas"
        )
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    local = saved == layout  # the same ranks and recipe: the ranks' own state too
    load_state(path, model, optimizer, averager, rank=rank, group=group, prefix=prefix, local=local)
    return meta

"""Checkpoints of a training run: what is saved for --resume, how, and how it is put back.

Each rank saves only what it holds (checkpoint/state.py names it: parameters, optimizer state,
compression and averager state), through torch.distributed.checkpoint, into a folder that is
committed atomically ([Note: atomic checkpoints] in checkpoint/folders.py). Rank 0 adds the run's
plain state as JSON: the step (the learning rate is a pure function of it), the data position
in global samples ([Note: global sample position] in data/stream.py), the loss scaler, and the
layout that wrote it. No random state needs saving: the reference models have no dropout, and
the data order depends only on the seed and the position. Loading reads, for whatever this run
holds, the overlapping parts of what the writers held, so a checkpoint resumes on another
number of ranks or under another strategy (docs/faults.md has the rules).

[Note: async checkpoints] With `checkpoint_save = "async"` the training thread only copies its
chunks into host buffers (reused from one save to the next; the only stall) and a background
thread writes them. On a machine whose cores all train (2 ranks on 2 cores here) the writing
still competes with training for CPU: BENCHMARKS.md measures both. The background
thread's collectives (DCP's plan exchange, a barrier) run on a process group of their own,
created by every rank at start, so they never interleave with the training's collectives on
the world group. One save is in flight at a time: the next one, the end of the run, and an
interruption wait for it.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

import dataparallel as dp

from ..checkpoint import (
    CheckpointError,
    Chunk,
    begin,
    check_same_model,
    commit,
    latest_checkpoint,
    load_chunks,
    load_state,
    model_shapes,
    read_metadata,
    read_train_state,
    save_chunks,
    state_chunks,
    step_name,
    stored_tensors,
    verify,
    write_safetensors,
)
from ..comm.groups import subgroup
from ..comm.plain import broadcast_plain
from .callbacks import Callback
from .export_hf import HF_EXPORT, export_hf
from .ledger import StepRecord
from .run_dir import CHECKPOINTS
from .state import TrainState

FINAL_WEIGHTS = "model.safetensors"


def weights_metadata(state: TrainState) -> dict:
    """What `dataparallel sample` (or anyone) needs to rebuild the model from the weights."""
    model_config = getattr(state.model, "config", None)
    is_config = dataclasses.is_dataclass(model_config) and not isinstance(model_config, type)
    if hasattr(model_config, "to_json_string"):  # a Hugging Face config (RUN/hf has it whole)
        plain = {"model_type": model_config.model_type, "path": str(state.source.path)}
    else:
        plain = dataclasses.asdict(model_config) if is_config else {}
    return {
        "model": state.model_name,
        "model_config": plain,
        "corpus_sha256": state.corpus.sha256,
        "step": state.step,
    }


def replica_prefix(state: TrainState) -> str:
    """The name prefix of this rank's replica's state ("" with one saved replica: with an
    averager each replica keeps its own parameters and optimizer state, checkpoint/state.py)."""
    layout = state.layout  # [Note: layout]
    return (
        f"replica{layout.saved_replica_of(state.world.rank)}/" if layout.saved_replicas > 1 else ""
    )


def layout_record(state: TrainState) -> dict:
    """The layout that wrote a checkpoint, as its run state records it: what rank-local state
    (compression residuals) depends on, so equal records can reuse it."""
    layout = state.layout
    return {
        "world_size": layout.world,
        "strategy": state.config.launch.strategy,
        "shard_group": layout.shard_size,
        "tp": layout.tp,
        "sync": dataclasses.asdict(state.config.sync),
    }


def run_state(state: TrainState) -> dict:
    """The plain (JSON) part of a checkpoint."""
    replicas = state.layout.saved_replicas
    prefix = "replica0/" if replicas > 1 else ""  # the export takes replica 0's weights
    names = dp.geometry(state.model).names
    weights = []
    for name, tensor in state.model.state_dict(keep_vars=True).items():
        first = names.get(id(tensor))
        key = f"model/{first}" if first is not None else f"model/{name}"
        weights.append([name, prefix + key])
    return {
        "step": state.step,  # also in the ledger: what `latest_checkpoint` and tools read
        "ledger": state.ledger.state_dict(),
        "global_batch": state.config.global_batch,
        "replicas": replicas,
        "layout": layout_record(state),
        "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        "shapes": model_shapes(state.model),
        "weights": weights,
        "metadata": weights_metadata(state),
    }


def saved_ledger(plain: dict) -> dict:
    """The ledger a checkpoint's run state holds ([Note: the ledger] in ledger.py). One written
    before the ledger (its step, data position and skipped steps at the top level) resumes as
    it did: no step in a row was non-finite at a save, and the random state, the evaluations
    and the clock are this session's."""
    if "ledger" in plain:
        return plain["ledger"]
    return {
        "step": plain["step"],
        "skipped_steps": plain["skipped_steps"],
        "consecutive_skips": 0,
        "samples": plain["samples"],
        "rng": torch.random.get_rng_state().numpy().tobytes().hex(),
        "evals": [],
        "elapsed_s": None,
    }


class Checkpointer:
    """Writes the run's checkpoints, in the background or not ([Note: async checkpoints])."""

    def __init__(self, run_dir: Path, state: TrainState, mode: str = "async"):
        self.folder = Path(run_dir) / CHECKPOINTS
        # The world and the checkpoint group are those of the first save (`_follow`): a live
        # run's replacement starts its loop in a world the others reach at that save.
        self.world = None
        self.group: dist.ProcessGroup | None = None
        self.executor = ThreadPoolExecutor(1, "checkpoint") if mode == "async" else None
        self.pending: Future | None = None
        self.staging: dict[str, torch.Tensor] = {}  # host buffers of async saves, reused

    @staticmethod
    def _new_group(world) -> dist.ProcessGroup | None:
        if world.world_size == 1:
            return None
        # every rank calls it; the world's timeout ([Note: inherited timeout] in comm/groups.py)
        return subgroup(None, world.group, local=False, backend="gloo")

    def _follow(self, state: TrainState) -> None:
        """The first save, or a live run regrouped since the last one ([Note: live recovery] in
        live/recovery.py): a save in flight then is dropped (its folder stays .tmp, the previous
        checkpoint the latest) and the checkpoint group is made (again) in the new world."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - its group lost a member: that save is abandoned
            pass
        self.world, self.group = state.world, self._new_group(state.world)

    def save(self, state: TrainState) -> None:
        """Checkpoint `state` now (collective: every rank calls it at the same step)."""
        if state.world is not self.world:
            self._follow(state)
        self.wait()
        chunks = state_chunks(
            state.model,
            state.optimizer,
            state.averager,
            rank=self.world.rank,
            prefix=replica_prefix(state),
        )
        plain = run_state(state) if self.world.is_main else {}
        if self.executor is None:
            self._write(chunks, state.step, plain)
        else:
            staged = {
                k: dataclasses.replace(c, tensor=self._stage(k, c.tensor))
                for k, c in chunks.items()
            }
            self.pending = self.executor.submit(self._write, staged, state.step, plain)

    def _stage(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor`, the only stall of an async save, into the buffer the last
        save used for `key` (free again: that save is over), so that only the first save
        allocates."""
        buffer = self.staging.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.staging[key] = torch.empty(tensor.shape, dtype=tensor.dtype)
        return buffer.copy_(tensor.detach())

    def _write(self, chunks: dict, step: int, plain: dict) -> None:
        tmp = self.folder / (step_name(step) + ".tmp")
        if self.world.is_main:
            begin(self.folder, step)
        if self.group is not None:
            dist.barrier(group=self.group)  # the folder exists before anyone writes into it
        save_chunks(chunks, tmp, self.group)
        if self.world.is_main:
            commit(tmp, plain)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, if any (raising its error)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.wait(timeout)
        if self.executor is not None:
            self.executor.shutdown(wait=timeout is None)


def export_weights(checkpoint: Path, path: Path) -> None:
    """The checkpoint's model as one safetensors file that plain PyTorch loads (rank 0 only):
    read from the checkpoint one tensor at a time, so no rank ever holds the whole model."""
    entries, read, metadata = checkpoint_weights(checkpoint)
    write_safetensors(path, entries, read, metadata)


def checkpoint_weights(checkpoint: Path):
    """(entries, read, metadata) of a checkpoint's model: (name, shape, dtype) of each
    state-dict entry, `read(name)` giving one tensor at a time, and the run's metadata."""
    plain = read_train_state(checkpoint)  # this rank just committed it: no CRC pass needed
    stored = dict(plain["weights"])
    metadata = read_metadata(checkpoint)  # once: 0.5 s for a tensor-parallel run's 2 MB
    dtypes = stored_tensors(checkpoint, metadata)
    entries = [(name, plain["shapes"][name], dtypes[key][1]) for name, key in plain["weights"]]

    def read(name: str) -> torch.Tensor:
        size, dtype = dtypes[stored[name]]
        tensor = torch.empty(size, dtype=dtype)
        load_chunks({stored[name]: Chunk(tensor)}, checkpoint, None, metadata)
        return tensor

    return entries, read, plain["metadata"]


def resolve_checkpoint(run_dir: Path, name: str = "") -> Path:
    """The checkpoint to resume from: `name` under run_dir/checkpoint, or the latest."""
    folder = Path(run_dir) / CHECKPOINTS
    path = folder / name if name else latest_checkpoint(folder)
    if path is None or not path.is_dir():
        raise CheckpointError(f"{run_dir} has no complete checkpoint to resume from")
    return path


def restore(state: TrainState, run_dir: Path, name: str = "") -> None:
    """Continue from a checkpoint of run_dir (every rank calls it): checked on rank 0 (its
    files against the manifest), then loaded by every rank from what it now holds."""
    found: list = [None]
    if state.world.is_main:
        try:
            path = resolve_checkpoint(run_dir, name)
            found = [(str(path), verify(path), None)]
        except CheckpointError as error:
            found = [(None, None, str(error))]
    if state.world.world_size > 1:
        found = [broadcast_plain(found[0], src=0, group=state.world.group)]  # never a pickle
    path, plain, error = found[0]
    if error:
        raise CheckpointError(error)
    check_same_model(state.model, plain["shapes"])
    if plain["global_batch"] != state.config.global_batch:
        raise CheckpointError(
            f"the checkpoint was trained with a global batch of {plain['global_batch']} windows, "
            f"this run has {state.config.global_batch}; keep the global batch (docs/faults.md)"
        )
    replicas = state.layout.saved_replicas
    if plain["replicas"] != replicas:
        raise CheckpointError(
            f"the checkpoint holds {plain['replicas']} replicas (--local-sgd/--diloco), this run "
            f"has {replicas}; resume with {plain['replicas']} replicas"
        )
    load_state(
        path,
        state.model,
        state.optimizer,
        state.averager,
        rank=state.world.rank,
        group=state.world.group if state.world.world_size > 1 else None,
        prefix=replica_prefix(state),
        local=plain["layout"] == layout_record(state),
    )
    state.ledger.load_state_dict(saved_ledger(plain))
    if state.scaler is not None and plain["scaler"]:
        state.scaler.load_state_dict(plain["scaler"])


class CheckpointSaver(Callback):
    """Saves a checkpoint every `every` steps and at the end, then exports the final weights.

    run_dir: the run directory.
    every: steps between checkpoints; 0 saves only at the end.
    mode: "async" or "sync" ([Note: async checkpoints]).
    """

    def __init__(self, run_dir: Path, every: int, mode: str = "async"):
        self.run_dir = Path(run_dir)
        self.every = every
        self.mode = mode
        self.checkpointer: Checkpointer | None = None

    def on_start(self, state: TrainState) -> None:
        self.checkpointer = Checkpointer(self.run_dir, state, self.mode)

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        if self.every and record.step % self.every == 0 and record.step != state.last_step:
            self.checkpointer.save(state)

    def on_end(self, state: TrainState) -> None:
        self.checkpointer.save(state)
        self.checkpointer.close()
        # Every rank's part is written; rank 0 then exports the weights alone. Exported before
        # the barrier, the others would wait out the export under the group's timeout, which
        # a live run keeps short (a loaded machine took more than its 6 s: a run lost at its end).
        if state.world.world_size > 1:
            dist.barrier(group=state.world.group)
        if state.world.is_main:
            folder = latest_checkpoint(self.run_dir / CHECKPOINTS)
            export_weights(folder, self.run_dir / FINAL_WEIGHTS)
            if state.source is not None:  # an hf:DIR model: a save_pretrained directory too
                entries, read, _ = checkpoint_weights(folder)
                export_hf(entries, read, self.run_dir / HF_EXPORT, state.source, state.model)

    def close(self, timeout: float | None = None) -> None:
        """Wait for a save in flight (on an interruption, before the process ends)."""
        if self.checkpointer is not None:
            self.checkpointer.close(timeout)

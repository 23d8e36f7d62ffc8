"""Chunks in, chunks out: `torch.distributed.checkpoint` (DCP) saving and loading what each rank
holds, whatever the strategy and world size that wrote it.

[Note: checkpoint chunks] Every checkpointed tensor is stored in its true global shape, and each
rank contributes a `Chunk`: its contiguous run of the tensor's flattened (row-major) elements
and where the run starts. That is exactly what every strategy holds: DDP the whole tensor
(offset 0), ZeRO-1/2/3 the part of each parameter inside its flat shard ([Note: shard layout] in
strategies/parts/layout.py), which need not follow any even split. A run is written as the boxes
of the tensor it covers (`rectangles`: a partial row, whole rows, a partial row, the partial
ones split likewise one dimension down; at most 2(N-1)+1 for N dimensions), each a view of the
run, each its own DCP chunk with N-d offsets and sizes. DTensor's placements cannot express such
runs (their chunks follow `torch.chunk`), so the two planners below describe the boxes to DCP
directly: DCP's global plan then removes duplicates (the same box saved by every replica of a
2-D mesh, or by every DDP rank, is written once) and checks that the boxes tile each tensor, and
on load it reads, for any other set of boxes, the overlapping parts of the stored ones. A 0-d
tensor (Adam's `step`) is a chunk of itself. A run of a tensor-parallel parameter's local tensor
([Note: tensor-parallel parameters] in strategies/parts/tensor_parallel.py) is not one run of
the whole tensor's elements but several (a local tensor of column blocks has one per row): its
chunk lists them (`runs`), each written and read as the boxes it covers, and boxes that stack
into one are one (`stacked`: a local tensor of column blocks is one box), so the stored tensor is
the whole one, the same as a run without tensor parallelism writes, and any tp size reads it
back.

Names are paths: "model/tok_emb.weight" is stored under DCP's key "model.tok_emb.weight" with
the nesting ("model", "tok_emb.weight") in the metadata's `planner_data`, what DCP itself keeps
for a nested state dict. So PyTorch's `dcp_to_torch_save` gives {"model": {"tok_emb.weight":
tensor(256, 144), ...}, "optim": ...}, the model's own state dict under "model"; our readers
translate the keys back (`stored_tensors` and the load planner speak names). A checkpoint
written before true shapes (1-D tensors under the names themselves, no nesting) is still read:
a load asks for the boxes of each tensor in the shape it is stored in, so a flat stored tensor
is read as one run of the flattened elements.

What DCP reads and its ranks send each other is unpickled safely: [Note: no unpickling] in
checkpoint/unpickling.py.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..torch_internals import dedup_save_plans
from .folders import CheckpointError
from .global_plan import global_save_plan
from .rectangles import rectangles, stacked
from .unpickling import SafeReader, plans_unpickled_safely, read_metadata

# DCP warns on every call without a process group that it assumes one process: we mean it.
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)


@dataclass
class Chunk:
    """This rank's part of one checkpointed tensor ([Note: checkpoint chunks]).

    tensor: the elements, 1-D; saving reads it, loading writes into it. A tensor of any
        other number of dimensions (a 0-d scalar, a matrix) is a whole tensor of that shape.
    offset: where a 1-D `tensor` starts in the flattened whole.
    numel: elements in the flattened whole (default: `tensor`'s own, a whole tensor).
    runs: where a 1-D `tensor` lies in the flattened whole when that is not one run: (position
        in `tensor`, offset in the whole, length) per part; None: one run at `offset`.
    shape: the whole tensor's true shape, what a save writes (default: `tensor`'s own shape
        for a whole tensor, else 1-D of `numel`). A load reads in whatever shape is stored.
    """

    tensor: torch.Tensor
    offset: int = 0
    numel: int | None = None
    runs: tuple[tuple[int, int, int], ...] | None = None
    shape: torch.Size | None = None

    def __post_init__(self):
        if self.numel is None:
            self.numel = self.tensor.numel()
        if self.tensor.dim() != 1 and (self.offset or self.numel != self.tensor.numel()):
            raise ValueError(
                f"Chunk: a part of a tensor must be 1-D, got shape {list(self.tensor.shape)}"
            )
        if self.shape is None:
            whole = self.tensor.dim() != 1 or self.numel == self.tensor.numel()
            self.shape = self.tensor.shape if whole else torch.Size([self.numel])
        self.shape = torch.Size(self.shape)
        if self.shape.numel() != self.numel:
            raise ValueError(
                f"Chunk: shape {list(self.shape)} has {self.shape.numel()} elements, "
                f"numel says {self.numel}"
            )

    def parts(self, shape=None) -> list[tuple[torch.Tensor, ChunkStorageMetadata]]:
        """(the elements, where they lie in the stored tensor) of each part of the chunk, for a
        stored tensor of `shape` (default: the chunk's own): each run of the flattened whole
        becomes the boxes it covers (`rectangles`), each box a view of the run; boxes that
        stack into one are one (`stacked`)."""
        shape = torch.Size(self.shape if shape is None else shape)
        if self.tensor.dim() != 1 and shape == self.tensor.shape:
            return [(self.tensor, ChunkStorageMetadata(torch.Size([0] * len(shape)), shape))]
        flat = self.tensor.view(-1)  # a whole tensor read in another shape: written in place
        runs = self.runs if self.runs is not None else ((0, self.offset, flat.numel()),)
        boxes = []
        for at, start, n in runs:
            for offsets, sizes in rectangles(shape, start, start + n):
                boxes.append((at, offsets, sizes))
                at += math.prod(sizes)
        out = [
            (
                flat[at : at + math.prod(sizes)].view(sizes),
                ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            )
            for at, offsets, sizes in stacked(boxes)
        ]
        if not out and shape.numel() == 0:  # an empty tensor is still stored
            out.append(
                (flat[:0].view(shape), ChunkStorageMetadata(torch.Size([0] * len(shape)), shape))
            )
        return out


def stored_name(name: str) -> str:
    """The key DCP stores `name` under ([Note: checkpoint chunks]): "model/tok_emb.weight" ->
    "model.tok_emb.weight", what `flatten_state_dict` makes of {"model": {"tok_emb.weight"}}."""
    return name.replace("/", ".")


def _names(metadata: Metadata) -> dict[str, str]:
    """name -> stored key of every tensor of a checkpoint: through the nesting DCP keeps in
    `planner_data`, or the key itself (a checkpoint written before the nesting)."""
    nesting = metadata.planner_data or {}
    return {
        "/".join(map(str, nesting[key])) if key in nesting else key: key
        for key in metadata.state_dict_metadata
    }


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes each rank's chunks; duplicates across ranks are removed by DCP's global plan."""

    def __init__(self, chunks: dict[str, Chunk]):
        # flatten_state_dict: DCP keeps the plans' `planner_data`, the nesting, in the metadata.
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        items = []
        self.parts = {}
        nesting = {}
        for name, chunk in self.chunks.items():
            key = stored_name(name)
            if key in nesting:
                raise ValueError(f"checkpoint: {name!r} and {'/'.join(nesting[key])!r} collide")
            nesting[key] = tuple(name.split("/"))
            for tensor, storage in chunk.parts():
                self.parts[key, storage.offsets] = tensor
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, storage.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=storage,
                            properties=TensorProperties.create_from_tensor(tensor),
                            size=chunk.shape,
                        ),
                    )
                )
        self.plan = SavePlan(items, planner_data=nesting)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's (its path without plan caching, which this planner leaves off), with the check
        of each tensor's boxes made linear ([Note: tiling check] in rectangles.py):
        `global_plan.py`."""
        dedup = partial(dedup_save_plans, self)
        self.global_plan, self.metadata = global_save_plan(all_plans, dedup)
        return self.global_plan, self.metadata

    def lookup_object(self, index: MetadataIndex):
        tensor = self.parts[index.fqn, index.offset].detach()
        # torch.save writes a view's whole storage: give it the chunk's own.
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        return tensor


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads, for each of this rank's chunks, the overlapping parts of the stored chunks, in
    the shape they were stored in (a flat one of a checkpoint written before shapes too)."""

    def __init__(self, chunks: dict[str, Chunk]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        self.parts = {}
        keys = _names(self.metadata)
        for name, chunk in self.chunks.items():
            key = keys[name]
            stored = self.metadata.state_dict_metadata[key]
            if stored.size.numel() != chunk.numel:
                raise ValueError(
                    f"{name!r} has {stored.size.numel()} elements in the checkpoint, "
                    f"{chunk.numel} here"
                )
            parts = chunk.parts(stored.size)
            self.parts.update({(key, storage.offsets): tensor for tensor, storage in parts})
            items += create_read_items_for_chunk_list(key, stored, [s for _, s in parts])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        tensor = self.parts[read_item.dest_index.fqn, read_item.dest_index.offset]
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of the chunk: the reader wrote into it


def save_chunks(chunks: dict[str, Chunk], folder, group: dist.ProcessGroup | None) -> None:
    """Write every rank's `chunks` into `folder` (collective over `group`; None: one process)."""
    writer = dcp.FileSystemWriter(str(folder), overwrite=True)
    state = {stored_name(name): chunk.tensor for name, chunk in chunks.items()}
    with plans_unpickled_safely():
        dcp.save(
            state,
            storage_writer=writer,
            planner=ChunkSavePlanner(chunks),
            process_group=group,
            no_dist=group is None,
        )


def load_chunks(
    chunks: dict[str, Chunk],
    folder,
    group: dist.ProcessGroup | None,
    metadata: Metadata | None = None,
) -> None:
    """Fill every rank's `chunks` from `folder` (collective over `group`; None: one process).
    Every key must be in the checkpoint (see `stored_tensors`). `metadata`: the folder's, read
    already (`read_metadata`), for a caller that loads it piece by piece."""
    state = {key: chunk.tensor for key, chunk in chunks.items()}
    reader = SafeReader(str(folder))
    reader.known = metadata
    try:
        with plans_unpickled_safely():
            dcp.load(
                state,
                storage_reader=reader,
                planner=ChunkLoadPlanner(chunks),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as error:  # one line: the first rank's root cause
        refused = reader.refused
        why = f"{type(refused).__name__}: {refused}" if refused else root_cause(error)
        raise CheckpointError(f"{folder} cannot be loaded: {why}") from None


def root_cause(error: CheckpointException) -> str:
    """The first sentence of the innermost exception in the failing ranks' tracebacks."""
    lines = [line.strip() for line in str(error).splitlines()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)(: |$)", line)]
    if not raised:
        return "unknown error"
    return raised[-1].split(". ")[0]


def stored_tensors(
    folder, metadata: Metadata | None = None
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor in the checkpoint `folder` (or in its `metadata`, read already): its whole
    size and dtype."""
    metadata = read_metadata(folder) if metadata is None else metadata
    out = {}
    for name, key in _names(metadata).items():
        entry = metadata.state_dict_metadata[key]
        if hasattr(entry, "size"):
            out[name] = (entry.size, entry.properties.dtype)
    return out

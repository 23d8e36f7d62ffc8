"""What a DCP checkpoint's metadata and its ranks' plans may build when they are unpickled.

[Note: no unpickling] DCP stores tensors with `torch.save` and reads them back with
`torch.load(weights_only=True)`, but its `.metadata` file is a pickle that
`FileSystemReader` reads with `pickle.load`, which runs whatever the file says. `SafeReader`
reads it with an unpickler that only builds DCP's own metadata classes, torch sizes and dtypes,
and plain containers; anything else is refused before it is called. Non-tensor state never
goes through DCP's pickled byte items: the trainer writes it as JSON.
"""

from __future__ import annotations

import io
import pickle
import threading
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..torch_internals import object_unpickler, set_object_unpickler

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # file names in the storage metadata
    ("pathlib", "PurePosixPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else ([Note: no unpickling])."""

    def find_class(self, module: str, name: str):
        if "." in name:  # protocol 4 resolves a dotted name through the module: os.system
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module.startswith(_ALLOWED_MODULE_PREFIXES):
            found = super().find_class(module, name)  # DCP's own classes, not what it imports
            if isinstance(found, type) and found.__module__.startswith(_ALLOWED_MODULE_PREFIXES):
                return found
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class _PeerUnpickler(_MetadataUnpickler):
    """What DCP's ranks send each other while they plan: its plans and metadata, and a rank's
    failure (an exception class and its traceback's summary), nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in (("traceback", "StackSummary"), ("traceback", "FrameSummary")):
            return super(_MetadataUnpickler, self).find_class(module, name)
        if "." not in name and module.split(".")[0] in ("builtins", "torch", "dataparallel"):
            found = super(_MetadataUnpickler, self).find_class(module, name)
            if isinstance(found, type) and issubclass(found, BaseException):
                return found
        return super().find_class(module, name)


@contextmanager
def plans_unpickled_safely():
    """DCP plans a save or a load through torch's `*_object` collectives, which unpickle what
    the other ranks send; while it runs, they unpickle with `_PeerUnpickler` ([Note: nothing
    unpickled] in comm/plain.py). Counted, as an async save plans in a thread of its own."""
    with _PLANNING["lock"]:
        if _PLANNING["depth"] == 0:
            _PLANNING["saved"] = object_unpickler()
            set_object_unpickler(_PeerUnpickler)
        _PLANNING["depth"] += 1
    try:
        yield
    finally:
        with _PLANNING["lock"]:
            _PLANNING["depth"] -= 1
            if _PLANNING["depth"] == 0:
                set_object_unpickler(_PLANNING["saved"])


_PLANNING = {"lock": threading.Lock(), "depth": 0, "saved": None}


def read_metadata(path) -> Metadata:
    """DCP's `.metadata` of the checkpoint folder `path`, read without running foreign code."""
    with open(f"{path}/.metadata", "rb") as handle:
        return _MetadataUnpickler(io.BytesIO(handle.read())).load()


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read by `read_metadata`. A refusal is kept in
    `refused`: torch 2.11's loader catches what `read_metadata` raises and fails later on
    "metadata is None", which would hide why."""

    refused: Exception | None = None
    known: Metadata | None = None  # read already by the caller: not read again

    def read_metadata(self, *args, **kwargs) -> Metadata:
        try:
            metadata = self.known if self.known is not None else read_metadata(self.path)
        except pickle.UnpicklingError as error:
            self.refused = error
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

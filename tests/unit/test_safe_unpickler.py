"""DCP's metadata is read without running foreign code ([Note: no unpickling] in
checkpoint/unpickling.py): a pickle that reaches os.system through an allowed module is refused."""

from __future__ import annotations

import io
import pickle

import pytest

from dataparallel.checkpoint.unpickling import _MetadataUnpickler


def _calls(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that calls module.name(argument) when loaded."""

    def text(s: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()

    return (
        b"\x80\x04" + text(module) + text(name) + pickle.STACK_GLOBAL
        + text(argument) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP
    )  # fmt: skip


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.filesystem", "os.system"),  # a dotted name
        ("torch.distributed.checkpoint.filesystem", "os"),  # a module DCP imports
        ("torch.distributed.checkpoint.state_dict_saver", "save"),  # a function, not a class
        ("os", "system"),
    ],
)
def test_a_pickle_that_calls_out_is_refused(tmp_path, module, name):
    target = tmp_path / "ran"
    payload = _calls(module, name, f"touch {target}")
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        _MetadataUnpickler(io.BytesIO(payload)).load()
    assert not target.exists()


def test_dcp_metadata_classes_still_load():
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(chunk))).load() == chunk

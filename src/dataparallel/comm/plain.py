"""Peers' values as JSON and raw tensor bytes, never as pickles.

    everyone = all_gather_plain({"hash": "ab12", "shape": (3, 4)}, group)  # a list, rank order
    payload = broadcast_plain(state_dict if rank == src else None, src, group)
    buffer = to_bytes(value); value = from_bytes(buffer)                   # the wire format

[Note: nothing unpickled] torch's `*_object` collectives pickle what one rank sends and
unpickle it on the others, and unpickling runs whatever the bytes say: a peer that is not
ours (or a member of a live run that was let in by mistake) could run code in every process
it sends to. What ranks exchange here is a value tree of plain leaves (None, bool, int,
float, str, torch.dtype) and tensors (numpy arrays too: a numpy generator's state), in containers (dict, list, tuple), encoded as one uint8
tensor: an 8-byte length, a JSON header that describes the tree (tensors by index, with their
dtype, shape and device kind), then each tensor's raw bytes. Decoding only parses JSON and
copies bytes into tensors of the dtypes named in DTYPES: there is nothing in it to run.
Everything a peer sends goes through here (the heal of a live run, the config exchange, the
model check, the sharded optimizer's description, a checkpoint's check, inference's and the
data loader's gathers); `checkpoint/unpickling.py` reads DCP's own pickled metadata, and the plans
DCP's ranks exchange through torch's `*_object` collectives, with an unpickler that builds
DCP's classes only.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .dry import is_fake
from .progress import DTYPES as PROGRESS_DTYPES

# The dtypes a tensor may have on the wire (a name outside it is refused, never looked up): the
# ones the collectives' progress records know (progress.py).
DTYPES = {str(d).removeprefix("torch."): d for d in PROGRESS_DTYPES}
NUMPY_DTYPES = {
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
}
LENGTH_BYTES = 8  # the header's length, little-endian, before the header


class PlainError(ValueError):
    """A value that cannot travel as plain data, or bytes that do not decode as such."""


# -- the tree, as a JSON header and a list of tensors ---------------------------------------------
def encode(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """(the JSON-able header of `value`, its tensors in header order)."""
    tensors: list[torch.Tensor] = []

    def walk(node, path: str):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, torch.dtype):
            return {"dtype": str(node).removeprefix("torch.")}
        if torch.is_tensor(node):
            tensors.append(node)
            return {"tensor": len(tensors) - 1}
        if isinstance(node, np.ndarray) and node.dtype.name in NUMPY_DTYPES:  # a numpy RNG's
            tensors.append(torch.from_numpy(np.ascontiguousarray(node).reshape(-1).view(np.uint8)))
            return {"ndarray": [len(tensors) - 1, node.dtype.name, list(node.shape)]}
        if isinstance(node, np.generic):
            return walk(node.item(), path)
        if isinstance(node, (list, tuple)):
            items = [walk(item, f"{path}[{i}]") for i, item in enumerate(node)]
            return items if isinstance(node, list) else {"tuple": items}
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node):
                return {"dict": {k: walk(v, f"{path}.{k}") for k, v in node.items()}}
            return {"pairs": [[walk(k, path), walk(v, f"{path}[{k!r}]")] for k, v in node.items()]}
        raise PlainError(
            f"{path or 'value'}: a {type(node).__name__} cannot travel between ranks (plain "
            "values, tuples, lists, dicts and tensors only); send its fields (dataclasses.asdict)"
        )

    return walk(value, ""), tensors


def decode(header: Any, tensors: list[torch.Tensor]) -> Any:
    """The value `encode` described; PlainError on a header that is not one of its shapes."""

    def walk(node):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise PlainError(f"not a plain value's header: {str(node)[:80]}")
        ((tag, body),) = node.items()
        if tag == "dict" and isinstance(body, dict):
            return {k: walk(v) for k, v in body.items()}
        if tag == "pairs" and isinstance(body, list):
            return {_key(walk(k)): walk(v) for k, v in body}
        if tag == "tuple" and isinstance(body, list):
            return tuple(walk(item) for item in body)
        if tag == "tensor" and isinstance(body, int) and 0 <= body < len(tensors):
            return tensors[body]
        if tag == "dtype" and body in DTYPES:
            return DTYPES[body]
        if tag == "ndarray" and isinstance(body, list) and len(body) == 3:
            index, dtype, shape = body
            if isinstance(index, int) and 0 <= index < len(tensors) and dtype in NUMPY_DTYPES:
                raw = tensors[index].cpu().numpy().tobytes()
                return np.frombuffer(raw, dtype=dtype).reshape([int(n) for n in shape]).copy()
        raise PlainError(f"not a plain value's header: {str(node)[:80]}")

    return walk(header)


def _key(key):
    if isinstance(key, list):  # a list cannot be a key: a tuple was meant only as "tuple"
        raise PlainError("a dict key must be a plain value or a tuple")
    return key


# -- the wire format: one uint8 tensor ------------------------------------------------------------
def to_bytes(value: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    """`value` as one uint8 tensor on `device` ([Note: nothing unpickled])."""
    header, tensors = encode(value)
    described = [
        {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "cuda": t.is_cuda}
        for t in tensors
    ]
    for entry in described:
        if entry["dtype"] not in DTYPES:
            raise PlainError(f"a tensor of dtype {entry['dtype']} cannot travel between ranks")
    text = json.dumps({"value": header, "tensors": described}).encode()
    parts = [
        torch.tensor(list(len(text).to_bytes(LENGTH_BYTES, "little")), dtype=torch.uint8),
        torch.frombuffer(bytearray(text), dtype=torch.uint8),
    ]
    parts += [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts).to(device)


def from_bytes(buffer: torch.Tensor) -> Any:
    """The value in `buffer` (`to_bytes`'s output); tensors that were on a GPU come back on
    this process's current one, the others on the CPU. PlainError when it does not decode."""
    data = buffer.detach().to("cpu")
    length = int.from_bytes(bytes(data[:LENGTH_BYTES].tolist()), "little")
    end = LENGTH_BYTES + length
    if end > data.numel():
        raise PlainError(f"a header of {length} bytes in a message of {data.numel()}")
    try:
        described = json.loads(bytes(data[LENGTH_BYTES:end].numpy()))
        header, entries = described["value"], described["tensors"]
        tensors = []
        for entry in entries:
            dtype, shape = DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]]
            count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if end + count > data.numel():
                raise PlainError("a tensor runs past the end of the message")
            tensor = data[end : end + count].clone().view(dtype).reshape(shape)
            end += count
            tensors.append(tensor.cuda() if entry["cuda"] and torch.cuda.is_available() else tensor)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        if isinstance(error, PlainError):
            raise
        raise PlainError(f"not a plain message: {error}") from None
    return decode(header, tensors)


# -- collectives ----------------------------------------------------------------------------------
def wire_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's backend takes its tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_plain(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Rank `src`'s `value` (global rank, as dist.broadcast takes it) on every rank of `group`;
    two broadcasts (the length, then the bytes). The other ranks' `value` is ignored. A value
    `src` cannot encode raises PlainError on every rank (a length of -1), not a hang."""
    if is_fake(group):  # [Note: dry run] in dry.py: every rank holds the caller's value
        return value
    device = wire_device(group)
    mine, failure = None, None
    if dist.get_rank() == src:
        try:
            mine = to_bytes(value, device)
        except PlainError as error:
            failure = error
    size = torch.tensor([mine.numel() if mine is not None else -1], dtype=torch.int64)
    size = size.to(device)
    dist.broadcast(size, src=src, group=group)
    if failure is not None:
        raise failure
    if int(size.item()) < 0:
        raise PlainError(f"rank {src} could not send its value (it says why)")
    if mine is None:
        mine = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(mine, src=src, group=group)
    return value if dist.get_rank() == src else from_bytes(mine)


def all_gather_plain(value: Any, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `value`, in the group's rank order, on every rank of `group` (two
    all-gathers: the lengths, then the bytes padded to the longest)."""
    size = dist.get_world_size(group)
    if is_fake(group):  # [Note: dry run] in dry.py: every rank holds the caller's value
        return [value] * size
    device = wire_device(group)
    try:
        mine, failure = to_bytes(value, device), None
    except PlainError as error:  # said on every rank, not a hang: a length of -1
        mine, failure = torch.zeros(0, dtype=torch.uint8, device=device), error
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    length = torch.tensor([mine.numel() if failure is None else -1], dtype=torch.int64)
    dist.all_gather(lengths, length.to(device), group)
    if failure is not None:
        raise failure
    failed = [r for r, n in enumerate(lengths) if int(n.item()) < 0]
    if failed:
        raise PlainError(f"rank {failed[0]} of the group could not send its value (it says why)")
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(out, padded, group=group)
    return [from_bytes(b[: int(n.item())]) for b, n in zip(out, lengths, strict=True)]

"""What the engine does on real data only, and what it does instead in a dry run.

[Note: dry run] A dry run (`dataparallel plan --dry-run`, plan/dry_run.py) runs the real
engine for one rank of a large world in one process: PyTorch's fake process group
(`runtime.init_fake`), whose collectives return at once and leave their tensors as they are,
and a model on the meta device, whose tensors have shapes and dtypes and no data. Shapes are
all the engine needs almost everywhere; the few places that read values go through this
module, which on a real run does what they did before, and in a dry run:
- `to_host`: a copy of a meta tensor to a real device (the found-inf flag of a gradient shard,
  a norm) gives zeros: every value finite, nothing to skip;
- an object collective on the fake group (`all_gather_plain`, `broadcast_plain` in plain.py)
  returns the caller's own value from every rank (the ranks of a dry run are copies of the one
  simulated, and agree);
- `storage_key`: meta storages all have data pointer 0; they are told apart by identity.
What a dry run therefore cannot see is data-dependent control flow (a skipped step, a rank
that found an inf, a parameter no rank used), NCCL's own buffers and the network.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..torch_internals import storage_id

FAKE_BACKEND = "fake"


def is_fake(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` (default: the world) is PyTorch's fake process group."""
    return dist.is_initialized() and dist.get_backend(group) == FAKE_BACKEND


def to_host(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None):
    """`tensor.to(device, dtype)`; zeros of its shape when it is a meta tensor ([Note: dry
    run])."""
    if tensor.is_meta:
        return torch.zeros(tensor.shape, dtype=dtype or tensor.dtype, device=device)
    return tensor.to(device, dtype) if dtype is not None else tensor.to(device)


def storage_key(tensor: torch.Tensor):
    """What tells `tensor`'s storage apart from others: its data pointer and size, or, on the
    meta device (every pointer 0), the storage itself ([Note: dry run])."""
    storage = tensor.untyped_storage()
    if tensor.is_meta:
        return ("meta", storage_id(storage))
    return (storage.data_ptr(), storage.nbytes())

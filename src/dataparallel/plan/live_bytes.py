"""The bytes of meta storages alive at once during a dry run's step, and their peak.

[Note: meta peak] Meta tensors are never allocated, so no allocator reports a dry run's peak.
`LiveBytes` is a dispatch mode that notes the storage of every meta tensor an operator takes or
returns, from the moment it is entered (before `parallelize`, so every buffer the engine makes is
seen), and, while `measuring`, after each operator sums the current size of every storage still
alive (a storage the engine frees with `resize_(0)`, as ZeRO-3 frees a gathered unit, counts 0
until an operator fills it again). What it misses: memory no operator touches (none in our
engine), and the allocator's rounding, caching and fragmentation. The sum costs one pass over
the live storages per operator, so it is on for the measured step only.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Meta storages seen, and the peak of their live bytes while `measuring` ([Note: meta
    peak])."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.measuring = False
        self.peak = 0

    def note(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage from now on (a tensor made before the mode was entered)."""
        if tensor.is_meta:
            storage = tensor.untyped_storage()
            known = self.storages.get(storage._cdata)
            if known is None or known() is None:  # new, or a freed one's address reused
                self.storages[storage._cdata] = weakref.ref(storage)

    def live(self) -> int:
        """Bytes of the seen storages alive now."""
        total = 0
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is None:
                del self.storages[key]
            else:
                total += storage.nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten((out, args))[0]:
            if isinstance(value, torch.Tensor):
                self.note(value)
        if self.measuring:
            self.peak = max(self.peak, self.live())
        return out

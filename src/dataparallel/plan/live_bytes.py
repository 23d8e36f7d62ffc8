"""The bytes of meta storages alive at once during a dry run's step, their peak, and what was
alive at the peak, by where each storage was made.

[Note: meta peak] Meta tensors are never allocated, so no allocator reports a dry run's peak.
`LiveBytes` is a dispatch mode that notes the storage of every meta tensor an operator takes or
returns, from the moment it is entered (before `parallelize`, so every buffer the engine makes is
seen), and, while `measuring`, after each operator sums the current size of every storage still
alive (a storage the engine frees with `resize_(0)`, as ZeRO-3 frees a gathered unit, counts 0
until an operator fills it again). What it misses: memory no operator touches (none in our
engine), and the allocator's rounding, caching and fragmentation. The sum costs one pass over
the live storages per operator, so it is on for the measured step only.
Each storage carries the `tag` that was current when it was first seen (the caller sets the
phase: parallelize, forward, loss, backward, optimizer step; "(engine)" added when the
engine's own code made it, in its hooks) or one `label` gave it (the held state: parameters,
gradients, optimizer state); at each new peak the alive storages are
kept, so `peak_terms` says, by tag, what the peak was made of.
"""

from __future__ import annotations

import weakref

import torch

from ..torch_internals import TorchDispatchMode, caller_frame, storage_id, tree_flatten

ENGINE = ("dataparallel.strategies", "dataparallel.comm")


def engine_made() -> bool:
    """Whether the engine's code (a strategy, the comm layer) is on the stack: a storage made
    in its hooks (ZeRO-3's gathered units and full gradients, a bucket's reduction)."""
    frame = caller_frame(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(ENGINE):
            return True
        frame = frame.f_back
    return False


class LiveBytes(TorchDispatchMode):
    """Meta storages seen, the peak of their live bytes while `measuring`, and the storages
    alive at that peak with their tags ([Note: meta peak]).

    device: the device type whose storages count: "meta" in a dry run; "cpu" where a test
        measures a real run the same way (tests/dist/test_held_once.py).
    """

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = device
        self.storages: dict[int, weakref.ref] = {}
        self.tags: dict[int, str] = {}
        self.tag = "before the step"
        self.measuring = False
        self.peak = 0
        self.at_peak: dict[int, tuple[weakref.ref, int]] = {}
        self.peak_tags: dict[int, str] = {}

    def note(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage from now on (a tensor made before the mode was entered)."""
        if tensor.device.type == self.device:
            storage = tensor.untyped_storage()
            key = storage_id(storage)
            known = self.storages.get(key)
            if known is None or known() is None:  # new, or a freed one's address reused
                self.storages[key] = weakref.ref(storage)
                self.tags[key] = self.tag + (" (engine)" if engine_made() else "")

    def label(self, tensor: torch.Tensor | None, tag: str) -> None:
        """Tag `tensor`'s storage `tag`, at the peak already recorded too if it was alive
        there (a gradient made in backward before the peak and labelled after it)."""
        if tensor is None or tensor.device.type != self.device:
            return
        self.note(tensor)
        storage = tensor.untyped_storage()
        key = storage_id(storage)
        self.tags[key] = tag
        kept = self.at_peak.get(key)
        if kept is not None and kept[0]() is storage:
            self.peak_tags[key] = tag

    def tag_alive(self, tag: str) -> None:
        """Tag every storage alive now `tag` (what a step starts with)."""
        for key, ref in self.storages.items():
            if ref() is not None:
                self.tags[key] = tag

    def live(self) -> int:
        """Bytes of the seen storages alive now."""
        total = 0
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is None:
                del self.storages[key]
                self.tags.pop(key, None)
            else:
                total += storage.nbytes()
        return total

    def peak_terms(self) -> dict[str, int]:
        """Bytes alive at the peak by tag, largest first; they sum to `peak`."""
        out: dict[str, int] = {}
        for key, (_, nbytes) in self.at_peak.items():
            tag = self.peak_tags[key]
            out[tag] = out.get(tag, 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten((out, args))[0]:
            if isinstance(value, torch.Tensor):
                self.note(value)
        if self.measuring:
            total = self.live()
            if total > self.peak:
                self.peak = total
                alive = ((k, r, r()) for k, r in self.storages.items())
                self.at_peak = {
                    k: (r, s.nbytes()) for k, r, s in alive if s is not None and s.nbytes()
                }
                self.peak_tags = {k: self.tags[k] for k in self.at_peak}
        return out

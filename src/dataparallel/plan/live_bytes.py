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
Where no code resizes a storage by hand (a bare model's trace, [Note: transient peak] in
model.py), `resized_by_hand=False` keeps the sum as it goes instead: a storage's bytes change
only at an operator that takes or returns it, or at its death (a weak reference's callback), so
each operator costs what it touches, not a pass over every live storage; the storages alive at
a new peak are kept at the first fall after it (the state they were in at the peak).
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
    resized_by_hand: whether code outside operators resizes storages (the engine: ZeRO-3 frees
        a gathered unit with `resize_(0)`): every operator then sums every live storage.
        False: the sum is kept as it goes ([Note: meta peak]), for a trace without such code.
    """

    def __init__(self, device: str = "meta", *, resized_by_hand: bool = True):
        super().__init__()
        self.device = device
        self.resized_by_hand = resized_by_hand
        self.storages: dict[int, weakref.ref] = {}
        self.tags: dict[int, str] = {}
        self.tag = "before the step"
        self.measuring = False
        self.peak = 0
        self.at_peak: dict[int, tuple[weakref.ref, int]] = {}
        self.peak_tags: dict[int, str] = {}
        self.sizes: dict[int, int] = {}  # kept as it goes: a storage's bytes when last seen
        self.total = 0
        self.peak_unkept = False  # a new peak whose storages are kept at the next fall

    def note(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage from now on (a tensor made before the mode was entered)."""
        if tensor.device.type == self.device:
            storage = tensor.untyped_storage()
            key = storage_id(storage)
            known = self.storages.get(key)
            if known is None or known() is None:  # new, or a freed one's address reused
                self.storages[key] = self._ref(storage, key)
                self.tags[key] = self.tag + (" (engine)" if engine_made() else "")
            if not self.resized_by_hand:
                self._resized(key, storage.nbytes())

    def _ref(self, storage: torch.UntypedStorage, key: int) -> weakref.ref:
        if self.resized_by_hand:
            return weakref.ref(storage)

        def died(ref: weakref.ref) -> None:  # entries stay (a callback may run mid-iteration)
            if self.storages.get(key) is ref:
                self._resized(key, 0)

        return weakref.ref(storage, died)

    def _resized(self, key: int, nbytes: int) -> None:
        before = self.sizes.get(key, 0)
        if nbytes < before and self.peak_unkept:
            self._keep_peak()
        self.sizes[key] = nbytes
        self.total += nbytes - before

    def _keep_peak(self) -> None:
        """The storages alive now, as at the peak (nothing has fallen since it)."""
        self.peak_unkept = False
        self.at_peak = {k: (self.storages[k], n) for k, n in list(self.sizes.items()) if n}
        self.peak_tags = {k: self.tags[k] for k in self.at_peak}

    def label(self, tensor: torch.Tensor | None, tag: str) -> None:
        """Tag `tensor`'s storage `tag`, at the peak already recorded too if it was alive
        there (a gradient made in backward before the peak and labelled after it)."""
        if tensor is None or tensor.device.type != self.device:
            return
        if self.peak_unkept:
            self._keep_peak()
        self.note(tensor)
        storage = tensor.untyped_storage()
        key = storage_id(storage)
        self.tags[key] = tag
        kept = self.at_peak.get(key)
        if kept is not None and kept[0]() is storage:
            self.peak_tags[key] = tag

    def tag_alive(self, tag: str) -> None:
        """Tag every storage alive now `tag` (what a step starts with)."""
        if self.peak_unkept:
            self._keep_peak()
        for key, ref in self.storages.items():
            if ref() is not None:
                self.tags[key] = tag

    def live(self) -> int:
        """Bytes of the seen storages alive now."""
        if not self.resized_by_hand:
            return self.total
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
        if self.peak_unkept:
            self._keep_peak()
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
        if self.measuring and not self.resized_by_hand:
            if self.total > self.peak:
                self.peak, self.peak_unkept = self.total, True
        elif self.measuring:
            total = self.live()
            if total > self.peak:
                self.peak = total
                alive = ((k, r, r()) for k, r in self.storages.items())
                self.at_peak = {
                    k: (r, s.nbytes()) for k, r, s in alive if s is not None and s.nbytes()
                }
                self.peak_tags = {k: self.tags[k] for k in self.at_peak}
        return out

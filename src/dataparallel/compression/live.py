"""A compressed hook's state under live recovery: rewinding a step, healing a replacement.

    copy = StepCopy(hook)
    copy.take()                            # at every step's start
    copy.restore()                         # the step's collectives failed: as it was
    shared = shared_state(hook)            # the source's, broadcast with the heal
    load_shared_state(hook, shared)        # a replacement (or a member behind) takes it

[Note: compression across replicas] A live run (train/live/recovery.py) regroups when a replica is
lost and heals a replacement from a member. What a compressor keeps between steps is either
equal on every rank, because it was summed or drawn from one seed (*shared*), or this rank's
own error (*own*):

    state                                            kind    a replacement  the survivors
    the hook's `rounds` (exact before `start`)       shared  receives it    keep it
    PowerSGD's factors Q (summed), P (orthogonal)    shared  receives them  keep them
    PowerSGD's draws of fresh Qs (seeded)            shared  receives them  keep them
    error-feedback residuals (PowerSGD, top-k,       own     start at zero  keep theirs
      int8/fp8: the sender's and the chunk owner's)
    top-k's DGC velocity (its own gradient's)        own     starts at 0    keeps its own
    int8/fp8's layouts (the group of its residuals)  own     none yet       re-laid (1)
    bf16, fp16 (a cast)                              none
(1) [Note: quantised residuals after a regroup] in quantize.py.

Without the shared state a replacement goes wrong at once: its P = M Q on another Q is summed
with the others' (a wrong gradient on every rank), and with another `rounds` it sends exact
buckets while the others send factors. An own residual is what the sum still owes for this
rank's past gradients; the sum over ranks of the residuals is what the run owes. Copying the
source's to the replacement would count the source's error twice, so the replacement starts
at zero; the lost replica's residual is lost with it (the run misses it once: a little of the
gradients before the loss, what compression had held back).

A rewound step must also undo what the step changed before its collective failed: residuals
updated, Q orthogonalised in place, velocity moved, `rounds` counted, maybe a fresh Q drawn.
`StepCopy` copies every store at the step's start, into buffers kept from the last copy;
`restore` puts back fresh clones of them (a collective of the broken group still pending on
its thread may yet write into the tensors the failed step used: [Note: abandoned groups] in
train/live/recovery.py), so the redone step starts from the same state on every member.
"""

from __future__ import annotations

import torch

from .hook import CompressedHook


def random_state(compressor):
    """The compressor's random draws still to come (PowerSGD's), or None."""
    method = getattr(compressor, "random_state", None)
    return method() if method is not None else None


class StepCopy:
    """The whole state of `hook` at a step's start, to put back if the step is rewound.

    hook: the run's CompressedHook (the strategy's `stateful_hook()`).
    """

    def __init__(self, hook: CompressedHook):
        self.hook = hook
        self.copies: dict[tuple[str, object], torch.Tensor] = {}
        self.counters = hook.counters()
        self.random = random_state(hook.compressor)

    def take(self) -> None:
        """Copy the state as it is now, into the last copy's buffers (only a new key or a
        tensor of another shape allocates)."""
        copies = {}
        for name, store in self.hook.compressor.stores().items():
            for key, tensor in store.items():
                buffer = self.copies.get((name, key))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = torch.empty_like(tensor)
                copies[(name, key)] = buffer.copy_(tensor)
        self.copies = copies
        self.counters = self.hook.counters()
        self.random = random_state(self.hook.compressor)

    def restore(self) -> None:
        """Put the state `take` copied back, as new tensors ([Note: compression across
        replicas]); keys the interrupted step added are gone again."""
        stores = self.hook.compressor.stores()
        for store in stores.values():
            store.clear()
        for (name, key), buffer in self.copies.items():
            stores[name][key] = buffer.clone()
        self.hook.load_counters(self.counters)
        if self.random is not None:
            self.hook.compressor.load_random_state(self.random)


def shared_state(hook: CompressedHook) -> dict:
    """What every rank of the run holds equal ([Note: compression across replicas]): what a
    healed replica receives. Its own residuals are not in it."""
    compressor = hook.compressor
    stores = compressor.stores()
    return {
        "compressor": compressor.name,
        "rounds": hook.rounds,
        "stores": {name: dict(stores[name]) for name in compressor.shared_stores},
        "random": random_state(compressor),
    }


def load_shared_state(hook: CompressedHook, shared: dict) -> None:
    """Take `shared_state`'s output from the run's source: this rank's own state stays."""
    compressor = hook.compressor
    if shared["compressor"] != compressor.name:
        raise ValueError(
            f"compression: the source's state is {shared['compressor']}'s but this replica "
            f"compresses with {compressor.name}; every replica of a run uses the same --compress"
        )
    hook.load_counters((shared["rounds"], frozenset()))  # at a step boundary: no bucket seen
    stores = compressor.stores()
    for name, entries in shared["stores"].items():
        stores[name].clear()
        stores[name].update({key: tensor.clone() for key, tensor in entries.items()})
    if shared["random"] is not None:
        compressor.load_random_state(shared["random"])

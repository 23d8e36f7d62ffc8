"""ZeRO-1/2's parameter all-gather after the optimizer step, optionally overlapped.

Each rank's step updates only its slice of every bucket; one all-gather per bucket then gives
every rank the new full parameters ([Note: sharded step] in zero12/step.py).

[Note: overlapped parameter gather] By default `step()` waits for those all-gathers, so the
parameters are whole when it returns. With `overlap_param_gather=True` (as Megatron-LM's
distributed optimizer offers) `step()` only launches them, in the order the next forward reads
the buckets (roughly the last bucket first: buckets hold parameters in reverse order), and a
forward pre-hook on every module that owns sharded parameters waits for the gathers up to the
last bucket holding any parameter of that module or of its children (a module such as
`nn.MultiheadAttention` reads its child's weights without calling the child). The all-gathers
then run on the backend's thread while the forward computes, and the step is no longer a point
where the ranks wait for each other. The price is a window in which the parameters are stale:
between `step()` and the next forward, this rank's slice is new and the rest is old.
Everything on the library's side waits first (a forward or an eval forward, `model.state_dict()`
and `load_state_dict()` on any module that owns parameters, the next `step()`,
`full_state_dict`, checkpoints); code that reads or writes parameters directly in that window
(an EMA of the weights, a logged weight norm, a clamp) must call
`dataparallel.finish_param_gather(model)` first. A forward post-hook on the root waits for
whatever the forward did not read, so after any forward the parameters are whole. The hooks stay
for the life of the model, as the strategy does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...comm import Comm
from .opaque import opaque


class ParamGather:
    """The all-gathers of one step: `start` them, `wait_through` what a module reads, `finish`.

    buckets: (flat parameter buffer, this rank's slice of it) per bucket the optimizer steps,
        in bucket order.
    overlap: whether `start` returns with the gathers in flight ([Note: overlapped parameter
        gather]) or waits for them.
    """

    def __init__(self, buckets: list[tuple[torch.Tensor, torch.Tensor]], comm: Comm, overlap: bool):
        # Launch order: the reverse of bucket order, the order in which forward reads them.
        self.buckets = list(reversed(buckets))
        self.comm = comm
        self.overlap = overlap
        self.works: list[dist.Work] = []
        self.next_wait = 0
        self.handles: list = []  # the hooks `attach` registered

    @property
    def pending(self) -> bool:
        """Whether some gather has not been waited for (its data may or may not have arrived)."""
        return self.next_wait < len(self.works)

    def start(self) -> None:
        """Launch every bucket's all-gather (in place); wait for them unless overlapping."""
        self.finish()  # a gather still in flight would write over what the step just wrote
        if self.comm.world_size == 1:
            return
        self.comm.tracer.mark("param_gather_launch")
        with self.comm.tracer.labelled(what="parameters"):
            self.works = [
                self.comm.all_gather(flat, own, async_op=True) for flat, own in self.buckets
            ]
        self.next_wait = 0
        if not self.overlap:
            self.finish()

    def wait_through(self, position: int) -> None:
        """Wait for the gathers launched up to launch position `position`, in launch order."""
        while self.next_wait <= position and self.next_wait < len(self.works):
            self.comm.tracer.mark("param_gather_wait", position=self.next_wait)
            self.works[self.next_wait].wait()
            self.next_wait += 1
        if not self.pending:
            self.works, self.next_wait = [], 0

    def finish(self) -> None:
        """Wait for every gather still in flight: the parameters are whole afterwards."""
        self.wait_through(len(self.works) - 1)

    def attach(self, model: nn.Module) -> None:
        """The hooks that wait before the model's parameters are read or written."""
        position_of = {}
        for position, (flat, _) in enumerate(self.buckets):
            position_of[flat.untyped_storage().data_ptr()] = position

        def finish(*args) -> None:
            self.finish()

        handles = self.handles
        for module in model.modules():
            if not list(module.parameters(recurse=False)):
                continue
            positions = [
                position_of[p.untyped_storage().data_ptr()]
                for p in module.parameters()  # its children's too: it may read them directly
                if p.untyped_storage().data_ptr() in position_of
            ]
            if not positions:
                continue
            last = max(positions)
            handles.append(
                module.register_forward_pre_hook(
                    opaque(lambda *args, last=last: self.wait_through(last))
                )
            )
            handles.append(module.register_state_dict_pre_hook(finish))
            handles.append(module.register_load_state_dict_pre_hook(finish))
        handles.append(model.register_forward_hook(opaque(finish)))
        handles.append(model.register_state_dict_pre_hook(finish))
        handles.append(model.register_load_state_dict_pre_hook(finish))

    def detach(self) -> None:
        """Remove the hooks `attach` made (the buckets were laid out again)."""
        self.finish()
        for handle in self.handles:
            handle.remove()
        self.handles = []

"""The end of a synchronised backward, shared by every strategy: one callback, one agreement.

[Note: backward round] The first gradient hook of a synchronised backward opens a round and
queues a callback that autograd runs once the whole backward is done. The strategy's callback
launches what is left to reduce and waits for it; the round meanwhile agrees, across every rank
of the job (replicas included), on two things, in one small all-reduce of integers:
- which parameters no rank used ([Note: unused parameters]): a parameter that got no gradient
  anywhere keeps `.grad = None`, so the optimizer skips it as one process would;
- [Note: found inf] whether any rank's reduced gradient holds an inf or NaN (sharded
  strategies: a loss scaler's overflow under fp16 parameters or fp16 autocast, or a numerical
  fault). Each rank sees only its own shard, so without this one rank could step while another
  skips, and the parameter all-gather of the one would wait forever for the other; with it, a
  rank that finds one makes every shard's gradient non-finite on every rank
  (`FlatShard.poison`), and an unmodified `torch.amp.GradScaler` then skips the step
  everywhere, together. It costs one pass over this rank's gradient shard (`isfinite`) and no
  extra collective. DDP needs none: every rank holds the same reduced gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...comm import Comm
from ...comm.dry import to_host
from ...torch_internals import queue_after_backward


class BackwardRound:
    """Used-parameter flags for `n` parameters, and the callback at the end of backward.

    comm: every rank that contributes gradients (the whole job, not just the shard group).
    """

    def __init__(self, n: int, comm: Comm):
        self.comm = comm
        # Set from the hooks in a plain bytearray: a tensor write per parameter would be a
        # kernel launch each on CUDA. Sent as one tensor at the end.
        self.used = bytearray(n)
        self.queued = False
        self.nonfinite = False  # what the last agreement found ([Note: found inf])

    def open(self, at_end: Callable[[], None]) -> None:
        """Queue `at_end` to run when autograd finishes this backward (once per round)."""
        if not self.queued:
            queue_after_backward(at_end)
            self.queued = True

    def mark_used(self, i: int) -> None:
        self.used[i] = 1

    def start_agreement(self, shards: list | None = None):
        """Start the all-reduce of the used flags and, given the sharded strategy's flat
        shards (after their last reduction), of whether any of them holds an inf or NaN
        ([Note: found inf]); `finish_agreement` waits for it."""
        n = len(self.used)
        flags = torch.tensor([*self.used, 0], dtype=torch.int32, device=self.comm.device)
        bad = [s.nonfinite() for s in shards or () if s.store is not None]
        if bad:  # computed where the gradients are: no host sync before the all-reduce
            flags[n:] = to_host(torch.stack(bad).any(), flags.device, torch.int32)
        work = None
        if self.comm.world_size > 1:
            with self.comm.tracer.labelled(what="used flags"):
                work = self.comm.all_reduce(flags, async_op=True)
        return flags, work, shards

    def finish_agreement(self, pending) -> list[bool]:
        """Per parameter, whether any rank used it this round. If any rank found a non-finite
        gradient, every shard's gradient is made non-finite here ([Note: found inf])."""
        flags, work, shards = pending
        if work is not None:
            work.wait()
        values = flags.tolist()
        self.nonfinite = bool(values[-1])
        if values[-1]:
            for shard in shards or ():
                shard.poison()
        return [f > 0 for f in values[:-1]]

    def reset(self) -> None:
        self.used = bytearray(len(self.used))
        self.queued = False

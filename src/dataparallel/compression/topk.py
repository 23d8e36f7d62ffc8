"""Top-k sparsification with error feedback, and Deep Gradient Compression's momentum correction.

Each rank sends the k = ratio x n entries of largest magnitude of its (corrected) gradient, as
int32 indices and values; the ranks' sparse tensors are all-gathered and summed into a dense
one, identical on every rank. What a rank did not send stays in its residual ([Note: error
feedback]). All-gather rather than all-reduce: the ranks' index sets differ, so the sum of
W sparse tensors has up to W x k entries (Aji & Heafield 2017; Lin et al. 2018, "Deep Gradient
Compression"). Bytes per rank: k x (4 + value size), against 4n for fp32 (ratio 0.01: 2%).

momentum (DGC's momentum correction): with an optimizer without momentum (plain SGD), the
momentum is accumulated here, before selection, so that the entries a rank holds back keep
their momentum: u = m u + g, the residual accumulates u, and the momentum of sent entries is
cleared with them ("momentum factor masking").
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..comm.hooks import Ready, Then, WorkFuture
from .feedback import ErrorFeedback


class TopK:
    """Keep the largest `ratio` of the entries; error feedback keeps the rest for later.

    ratio: fraction of entries each rank sends, in (0, 1].
    momentum: DGC momentum correction factor in [0, 1); 0 turns it off.
    """

    name = "topk"
    shared_stores = ()  # residuals and velocities are each rank's own (compression/live.py)

    def __init__(self, ratio: float, momentum: float = 0.0):
        if not 0 < ratio <= 1:
            raise ValueError(f"topk: ratio={ratio} must be in (0, 1]; e.g. ratio=0.01 keeps 1%")
        if not 0 <= momentum < 1:
            raise ValueError(f"topk: momentum={momentum} must be in [0, 1); 0 turns it off")
        self.ratio, self.momentum = ratio, momentum
        self.feedback = ErrorFeedback()
        self.velocity: dict[object, torch.Tensor] = {}  # DGC's u, per key

    def count(self, numel: int) -> int:
        """Entries sent from a tensor of `numel`."""
        return max(1, min(numel, round(self.ratio * numel)))

    def compress(self, key, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, values) of the largest entries of `tensor` + momentum + residual; the
        rest becomes the residual. `tensor` (1-D) is consumed: it may be overwritten."""
        if self.momentum:
            u = self.velocity.get(key)
            if u is None:
                u = self.velocity[key] = torch.zeros_like(tensor)
            u.mul_(self.momentum).add_(tensor)
            tensor.copy_(u)
        corrected = self.feedback.correct(key, tensor)
        k = self.count(corrected.numel())
        indices = torch.topk(corrected.abs(), k, sorted=False).indices
        values = corrected[indices]
        residual = self.feedback.residuals.get(key)
        if residual is None:
            residual = torch.empty_like(corrected)
        residual.copy_(corrected)
        residual[indices] = 0  # sent + residual == corrected, exactly (disjoint entries)
        self.feedback.keep(key, residual)
        if self.momentum:
            self.velocity[key][indices] = 0
        return indices.to(torch.int32), values

    @staticmethod
    def decompress(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
        """The dense sum of sparse entries (indices may repeat across ranks)."""
        dense = torch.zeros(numel, dtype=torch.float32, device=values.device)
        return dense.index_add_(0, indices.long(), values.float())

    def reduce(self, comm: Comm, key, tensor: torch.Tensor, keep, shapes=None, window=None):
        """Sum `tensor` (1-D) over `comm`, approximately; the future gives all of it, or the
        `keep` slice."""
        numel = tensor.numel()
        indices, values = self.compress(key, tensor)
        payload = torch.cat([indices.view(torch.uint8), values.contiguous().view(torch.uint8)])

        def unpack(gathered: torch.Tensor) -> torch.Tensor:
            k = indices.numel()
            rows = gathered.view(comm.world_size, -1)
            all_indices = rows[:, : 4 * k].contiguous().view(torch.int32).reshape(-1)
            all_values = rows[:, 4 * k :].contiguous().view(values.dtype).reshape(-1)
            dense = self.decompress(all_indices, all_values, numel)
            target = tensor if keep is None else tensor[keep[0] : keep[1]]
            source = dense if keep is None else dense[keep[0] : keep[1]]
            return target.copy_(source)

        if comm.world_size == 1:
            return Then(Ready(payload), unpack)
        gathered = torch.empty(comm.world_size * payload.numel(), dtype=torch.uint8)
        work = comm.all_gather(gathered, payload, async_op=True)
        return Then(WorkFuture(work, lambda: gathered), unpack)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.feedback.tensors() + list(self.velocity.values())

    def stores(self) -> dict[str, dict]:
        """The per-key state a checkpoint keeps (see `feedback.keyed_tensors`)."""
        return {"residual": self.feedback.residuals, "velocity": self.velocity}

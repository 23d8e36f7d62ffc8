"""PowerSGD: rank-r approximations of gradient matrices, with error feedback and warm start.

[Note: PowerSGD] (Vogels et al. 2019.) A gradient matrix M (n x m) is sent as two thin factors:
P = M Q (n x r) is all-reduced and orthogonalised, Q = M^T P (m x r) is all-reduced, and every
rank rebuilds P Q^T. Bytes per matrix: (n + m) r instead of n m. Q starts random (one seed,
the same on every rank) and is reused next step (warm start: one power iteration per step
keeps the subspace current). Tensors that would not shrink at least `min_compression_rate`
times (biases, norm weights, small matrices) are all-reduced uncompressed, in one buffer.
Error feedback keeps, per bucket, the corrected gradient minus this rank's share of what was
rebuilt: the rebuilt matrix approximates the sum over the W ranks of their (already divided)
buckets, so a rank's share is 1/W of it, and in undivided units the residual is PyTorch's and
the paper's, local gradient minus the approximated mean.

The semantics are those of PyTorch's `powerSGD_hook` (with `batch_tensors_with_same_shape`
off), which the tests hold it against: matrices are `tensor.view(shape[0], -1)`, the rank is
min(n, m, rank), random Qs are drawn per bucket after seeding torch from a NumPy RandomState,
in order of the matrices grouped by shape, and orthogonalised by Gram-Schmidt for r <= 2 and
QR above. One difference: our buckets arrive already divided by the number of ranks ([Note:
reduction interface]), so nothing is divided afterwards; the result is the same.

On the cross-replica stage of a 2-D mesh the tensor is a rank's shard of a bucket: each
parameter's whole rows inside it are compressed as a matrix, the partial rows at the shard's
edges travel uncompressed (`plan_matrices`).
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from ..comm import Comm
from ..comm.hooks import Chain, Ready, Then, WorkFuture
from .feedback import ErrorFeedback


def plan_matrices(shapes, start: int, numel: int, rank: int, min_rate: float):
    """Which parts of buffer[start : start + numel] are compressed: ([(offset, rows, cols,
    rank)], [(offset, stop)] uncompressed), offsets relative to `start`. `shapes` are the
    bucket's (offset, shape) per parameter."""
    stop = start + numel
    matrices = []
    for offset, shape in shapes:
        size = shape.numel()
        if len(shape) == 0 or size == 0:
            continue
        rows, cols = shape[0], size // shape[0]
        first = max(0, -(-(start - offset) // cols))  # first whole row inside the window
        last = min(rows, (stop - offset) // cols)  # one past the last
        if last <= first:
            continue
        n = last - first
        r = min(n, cols, rank)
        if (n + cols) * r * min_rate < n * cols:  # PyTorch's _should_compress
            matrices.append((offset + first * cols - start, n, cols, r))
    vectors, position = [], 0
    for offset, n, cols, _ in sorted(matrices):
        if offset > position:
            vectors.append((position, offset))
        position = offset + n * cols
    if position < numel:
        vectors.append((position, numel))
    return matrices, vectors


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormal columns of each (1, n, r) matrix, in place: Gram-Schmidt for r <= 2 or half
    precision, QR otherwise (PyTorch's hook's choice, for the same numbers)."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        tiny = torch.finfo(matrices.dtype).tiny  # a zero column stays zero, not NaN
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            col /= torch.norm(col, dim=1, keepdim=True).clamp_min(tiny) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        r = torch.empty(matrices.shape[0], rank, rank, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))


class PowerSGD:
    """Rank-`rank` compression of gradient matrices ([Note: PowerSGD]).

    rank: columns of P and Q (PyTorch's matrix_approximation_rank), at least 1.
    min_compression_rate: compress a matrix only if that shrinks it at least this many times.
    error_feedback: keep what the approximation missed for the next step.
    warm_start: reuse last step's Q (else draw a new random one every step).
    seed: seeds the random Qs (the same on every rank).
    """

    name = "powersgd"
    # Equal on every rank ([Note: compression across replicas] in compression/live.py): the
    # factors (Q is summed; P, summed then orthogonalised, is also what marks a warm start).
    shared_stores = ("p", "q")

    def __init__(
        self,
        rank: int = 1,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd: rank={rank!r} must be an integer >= 1 (e.g. rank=4)")
        if min_compression_rate < 1:
            raise ValueError(f"powersgd: min_compression_rate={min_compression_rate} must be >= 1")
        self.rank, self.min_rate = rank, min_compression_rate
        self.error_feedback, self.warm_start = error_feedback, warm_start
        try:  # PyTorch's hook draws its seeds from NumPy; so do we, for the same Qs
            import numpy

            self.rng = numpy.random.RandomState(seed)
        except ImportError:  # pragma: no cover - numpy comes with the dev dependencies
            self.rng = random.Random(seed)
            self.rng.randint = lambda high: random.Random.randrange(self.rng, high)
        self.feedback = ErrorFeedback()
        self.p_memory: dict[object, torch.Tensor] = {}
        self.q_memory: dict[object, torch.Tensor] = {}
        self.plans: dict[object, tuple] = {}

    @staticmethod
    def largest_rank(shapes: list[torch.Size]) -> int:
        """The largest rank any matrix among `shapes` can take (its smaller side)."""
        return max((min(s[0], s.numel() // s[0]) for s in shapes if len(s) >= 2), default=0)

    def check(self, shapes: list[torch.Size]) -> None:
        """Refuse a rank no matrix among `shapes` can take (every one would go uncompressed)."""
        largest = self.largest_rank(shapes)
        if self.rank > largest:
            raise ValueError(
                f"powersgd: rank={self.rank} exceeds what any gradient matrix allows (at most "
                f"{largest}, its smaller side); pick rank <= {largest}"
            )

    def reduce(self, comm: Comm, key, tensor: torch.Tensor, keep, shapes, window=None):
        """Sum `tensor` (1-D: buffer[window[0]:] of a bucket with `shapes`) over `comm`,
        approximately; the future gives all of it, or the `keep` slice."""
        if key not in self.plans:
            start = window[0] if window is not None else 0
            self.plans[key] = plan_matrices(shapes, start, tensor.numel(), self.rank, self.min_rate)
        matrices, vectors = self.plans[key]
        if self.error_feedback:
            self.feedback.correct(key, tensor)
            came_in = tensor.clone()
        uncompressed = torch.cat([tensor[a:b] for a, b in vectors]) if vectors else tensor[:0]
        by_shape = defaultdict(list)  # PyTorch's order: matrices grouped by shape
        for offset, n, m, r in matrices:
            by_shape[(n, m)].append((offset, n, m, r))
        ordered = [entry for group in by_shape.values() for entry in group]
        fresh = not self.warm_start or key not in self.p_memory
        if fresh:
            self.p_memory[key] = tensor.new_empty(sum(n * r for _, n, _, r in ordered))
            self.q_memory[key] = tensor.new_empty(sum(m * r for _, _, m, r in ordered))
        mats, ps, qs, p_at, q_at = [], [], [], 0, 0
        for offset, n, m, r in ordered:
            mats.append(tensor[offset : offset + n * m].view(1, n, m))
            ps.append(self.p_memory[key][p_at : p_at + n * r].view(1, n, r))
            qs.append(self.q_memory[key][q_at : q_at + m * r].view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r
        if fresh:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(self.rng.randint(1_000_000_000)))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=q.dtype))
                    orthogonalize(q)
        else:
            for q in qs:
                orthogonalize(q)
        for mat, q, p in zip(mats, qs, ps, strict=True):
            torch.bmm(mat, q, out=p)
        first = _all_reduce(comm, [uncompressed, self.p_memory[key]])

        def compute_qs(_):
            position = 0
            for a, b in vectors:  # the uncompressed sums go back to their places
                tensor[a:b].copy_(uncompressed[position : position + b - a])
                position += b - a
            for p in ps:
                orthogonalize(p)
            for mat, p, q in zip(mats, ps, qs, strict=True):
                torch.bmm(mat.transpose(1, 2), p, out=q)
            return _all_reduce(comm, [self.q_memory[key]])

        def decompress(_):
            for p, q, mat in zip(ps, qs, mats, strict=True):
                torch.bmm(p, q.transpose(1, 2), out=mat)
            if self.error_feedback:  # this rank's share of the approximated sum
                self.feedback.remember(key, came_in, tensor / comm.world_size)
            if not self.warm_start:
                self.p_memory.clear()
                self.q_memory.clear()
            elif not torch.isfinite(self.q_memory[key].sum()):
                # An fp16 overflow reached the factors (the same on every rank: Q is summed),
                # so every rank draws this key's Q afresh next time.
                del self.p_memory[key], self.q_memory[key]
            return tensor if keep is None else tensor[keep[0] : keep[1]]

        return Then(Chain(first, compute_qs), decompress)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.feedback.tensors() + list(self.p_memory.values()) + list(self.q_memory.values())

    def stores(self) -> dict[str, dict]:
        """The per-key state a checkpoint keeps (see `feedback.keyed_tensors`)."""
        return {"residual": self.feedback.residuals, "p": self.p_memory, "q": self.q_memory}

    def random_state(self):
        """Where the draws of fresh Qs stand: equal on every rank, like the Qs they seed."""
        return self.rng.get_state() if hasattr(self.rng, "get_state") else self.rng.getstate()

    def load_random_state(self, state) -> None:
        if hasattr(self.rng, "set_state"):
            self.rng.set_state(state)
        else:  # pragma: no cover - numpy comes with the dev dependencies
            self.rng.setstate(state)


def _all_reduce(comm: Comm, tensors: list[torch.Tensor]):
    """Sum each of `tensors` over `comm` in place, in order; the future gives the last."""
    if comm.world_size == 1:
        return Ready(tensors[-1])
    works = [comm.all_reduce(t, async_op=True) for t in tensors if t.numel()]
    return WorkFuture(_AllWorks(works), lambda: tensors[-1])


class _AllWorks:
    def __init__(self, works):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()

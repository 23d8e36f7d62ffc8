"""Whole-parameter ownership and Muon's compute, as the planner predicts them (docs/plan.md).

[Note: owner imbalance] An optimizer that looks at a whole parameter (Muon, Adafactor, Shampoo,
a LAMB-style trust ratio) cannot step a flat shard: each of its parameters is owned whole by
one rank of the shard group, which holds its optimizer state and steps it (issue 29). Flat
shards give every rank 1/N of the elements; owners give each rank whole parameters, so the
busiest rank holds at least the largest parameter, whatever N. Owners are balanced as the
strategies balance them, greedily by size, largest first, each to the least loaded rank
(longest-processing-time first: within 4/3 of the best split, and exact once the parameters
outnumber the ranks by far). The per-rank optimizer memory is the busiest rank's, and the
imbalance is busiest / mean: 1.0 for many small parameters, growing with N once the ranks
outnumber the parameters (then most ranks own nothing). Example: llama-8b's 4096 x 14336 MLP
matrix alone is 58.7M elements, 0.70 GB of fp32 master and Adam-like state (12 bytes) on its
owner, where flat shards over 4,096 ranks hold 23 MB each.

[Note: Muon's compute] Muon orthogonalises each matrix's update with Newton-Schulz: 5
iterations of X X^T (2 m^2 n FLOPs for an m x n matrix, m <= n), a polynomial in it (2 m^3) and
its product with X (2 m^2 n): 5 (4 m^2 n + 2 m^3) per matrix per step. Forward and backward
cost 6 m n FLOPs per token for that matrix, so for a d x d matrix and B tokens per step the
ratio is 30 d^3 / 6 d^2 B = 5 d / B (torch.optim.Muon's defaults; the embeddings and the head,
left to AdamW in the usual recipe, are not counted). Distributed, each matrix is orthogonalised
once per shard group by its owner (balanced by FLOPs), so a rank's share stays about 5 d / B of
its own forward and backward; under DDP every rank orthogonalises every matrix, N times that.
Muon's step dominates the step when its share passes 1: B < 5 d distributed, B < 5 d N under
DDP (B: the global batch's tokens per optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..strategies import assign_owners as owners_of
from .errors import PlanError
from .model import ModelShape

NEWTON_SCHULZ_STEPS = 5  # torch.optim.Muon's ns_steps


@dataclass(frozen=True)
class Ownership:
    """Whole parameters spread over owners ([Note: owner imbalance]).

    loads: per rank of the shard group, the elements (or FLOPs) it owns.
    """

    loads: tuple[float, ...]

    @property
    def busiest(self) -> float:
        return max(self.loads, default=0.0)

    @property
    def mean(self) -> float:
        return sum(self.loads) / len(self.loads) if self.loads else 0.0

    @property
    def imbalance(self) -> float:
        """Busiest / mean: 1.0 when perfectly balanced."""
        return self.busiest / self.mean if self.mean else 1.0

    @property
    def idle(self) -> int:
        """Ranks that own nothing."""
        return sum(1 for load in self.loads if load == 0)


def assign_owners(
    numels: list[int] | tuple[int, ...], ranks: int, weights: list[float] | None = None
) -> Ownership:
    """The owners the strategies choose (`strategies.assign_owners`, by elements: the same
    rule, not a copy of it), and each rank's load of `weights` (default: the elements)."""
    if ranks < 1:
        raise PlanError("ranks", f"{ranks} owners", "give a shard group of at least one rank")
    loads = [0.0] * ranks
    chosen = owners_of(list(numels), ranks)
    for owner, weight in zip(chosen, numels if weights is None else weights, strict=True):
        loads[owner] += weight
    return Ownership(tuple(loads))


@dataclass(frozen=True)
class OptimizerMemory:
    """Per-rank optimizer state of one shard group, flat shards against whole-parameter owners.

    flat_bytes: every rank's, with flat shards (the elements split evenly).
    owner_bytes: the busiest owner's, with whole parameters.
    ownership: the owners' loads in elements.
    """

    flat_bytes: float
    owner_bytes: float
    ownership: Ownership

    @property
    def imbalance(self) -> float:
        """owner_bytes / flat_bytes: what whole-parameter ownership costs the busiest rank."""
        return self.owner_bytes / self.flat_bytes if self.flat_bytes else 1.0


def optimizer_memory(
    numels: list[int] | tuple[int, ...], ranks: int, bytes_per_element: float
) -> OptimizerMemory:
    """The optimizer state per rank of a shard group of `ranks` for parameters of `numels`
    elements, `bytes_per_element` each (state and fp32 masters: 12 for Adam-like state under
    mixed precision, 8 in fp32)."""
    if bytes_per_element < 0:
        raise PlanError(
            "--optimizer", f"{bytes_per_element} bytes of state per element", "give 0 or more"
        )
    owners = assign_owners(list(numels), ranks)
    flat = -(-sum(numels) // ranks) * bytes_per_element
    return OptimizerMemory(flat, owners.busiest * bytes_per_element, owners)


def newton_schulz_flops(rows: int, cols: int, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """FLOPs of Muon's orthogonalisation of one rows x cols update ([Note: Muon's compute])."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


@dataclass(frozen=True)
class MuonCompute:
    """Muon's Newton-Schulz against the forward and backward, per rank ([Note: Muon's compute]).

    ranks: the shard group (the owners).
    newton_schulz: FLOPs of every matrix's orthogonalisation, one step.
    forward_backward: FLOPs of the forward and backward per rank, one step.
    busiest: FLOPs of Newton-Schulz on the busiest owner.
    """

    ranks: int
    newton_schulz: float
    forward_backward: float
    busiest: float

    @property
    def distributed_share(self) -> float:
        """Newton-Schulz on the busiest owner / a rank's forward and backward."""
        return self.busiest / self.forward_backward

    @property
    def ddp_share(self) -> float:
        """Every matrix on every rank (DDP) / a rank's forward and backward."""
        return self.newton_schulz / self.forward_backward

    def verdict(self) -> str:
        """One line: the shares, and whether Muon's step dominates."""
        where = [
            name
            for name, share in (("distributed", self.distributed_share), ("DDP", self.ddp_share))
            if share >= 1.0
        ]
        said = f"dominates the step ({' and '.join(where)})" if where else "does not dominate"
        return (
            f"Muon's Newton-Schulz is {self.distributed_share:.3g}x a rank's forward and "
            f"backward distributed over {self.ranks} owners, {self.ddp_share:.3g}x under DDP "
            f"(every rank runs every matrix): it {said}"
        )


def muon_matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """The 2-D weights Muon steps in the usual recipe: every matrix but the embeddings and the
    head, recognised by the vocabulary dimension, or, where the vocabulary is as wide as the
    model, as the first and the last matrix in registration order; all of them when the shape
    does not know its vocabulary."""
    if not shape.vocab:
        return list(shape.matrices)
    if shape.vocab != shape.width:
        return [m for m in shape.matrices if shape.vocab not in m]
    return list(shape.matrices[1:-1])


def muon_compute(
    shape: ModelShape,
    tokens_per_step: int,
    ranks: int,
    matrices: list[tuple[int, int]] | None = None,
) -> MuonCompute:
    """Muon's compute for `shape` at `tokens_per_step` (the global batch's tokens per optimizer
    step) over `ranks` data-parallel ranks; `matrices` defaults to `muon_matrices(shape)`."""
    if tokens_per_step < 1:
        raise PlanError("tokens_per_step", f"{tokens_per_step}", "give 1 or more tokens")
    if ranks < 1:
        raise PlanError("ranks", f"{ranks} ranks", "give at least one rank")
    chosen = muon_matrices(shape) if matrices is None else matrices
    flops = [newton_schulz_flops(rows, cols) for rows, cols in chosen]
    per_rank = shape.flops_per_token * tokens_per_step / ranks
    busiest = assign_owners([rows * cols for rows, cols in chosen], ranks, flops).busiest
    return MuonCompute(ranks, sum(flops), per_rank, busiest)

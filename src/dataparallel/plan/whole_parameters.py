"""What `plan --optimizer muon|adafactor` adds: the owners' optimizer memory per shard group
and Muon's compute (ownership.py's numbers for the job's recipes, docs/plan.md).

[Note: the planned optimizers] The job's recipes (train/optimizers.py):
- "muon": Muon (a 4-byte momentum per element) on `muon_matrices(shape)`, owned whole under
  ZeRO; AdamW (8 bytes) on the rest, in flat shards.
- "adafactor": torch.optim.Adafactor on every parameter, owned whole: a matrix keeps factored
  second moments (4 x (rows + cols) bytes), any other tensor a full one (4 bytes per element).
Under a precision policy with fp32 masters the owner holds each owned parameter's whole master
too (4 bytes per element). The table's optim column is the state split evenly, its average
bytes per parameter as K; the lines below it give, per sharded row, the busiest owner's bytes
(flat part included) and its imbalance against the even split, and for Muon the verdict of
[Note: Muon's compute] at the global batch's tokens per step over the data ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelShape
from .ownership import MuonCompute, Ownership, assign_owners, muon_compute, muon_matrices

WHOLE_PARAMETER_OPTIMIZERS = ("muon", "adafactor")
MUON_BYTES, ADAMW_BYTES, FACTOR_BYTES = 4, 8, 4


@dataclass(frozen=True)
class WholeParameters:
    """An optimizer's whole-parameter part, as the planner counts it.

    optimizer: "muon" or "adafactor".
    owned: bytes of each owned parameter's state (and master) on its owner.
    flat_bytes: bytes of the state kept in flat shards (Muon's AdamW part), over every rank
        of the shard group evenly.
    params: the model's parameters (the average's denominator).
    muon: Muon's compute, or None.
    """

    optimizer: str
    owned: tuple[float, ...]
    flat_bytes: float
    params: int
    muon: MuonCompute | None

    @property
    def state_bytes_per_param(self) -> float:
        """The average bytes per parameter: the table's K (the even split)."""
        return (sum(self.owned) + self.flat_bytes) / self.params if self.params else 0.0

    def per_rank(self, ranks: int) -> tuple[float, float, Ownership]:
        """(busiest rank's bytes, an even split's bytes, the owners) over a shard group."""
        owners = assign_owners(self.owned, ranks)
        flat = self.flat_bytes / ranks
        return owners.busiest + flat, (sum(self.owned) + self.flat_bytes) / ranks, owners


def whole_parameters(
    optimizer: str, shape: ModelShape, *, masters: bool, tokens_per_step: int, ranks: int
) -> WholeParameters:
    """The whole-parameter part of `optimizer` for `shape` ([Note: the planned optimizers])."""
    master = 4 if masters else 0
    if optimizer == "muon":
        matrices = muon_matrices(shape)
        owned = tuple(float((MUON_BYTES + master) * r * c) for r, c in matrices)
        rest = shape.params - sum(r * c for r, c in matrices)
        compute = muon_compute(shape, tokens_per_step, ranks, matrices)
        return WholeParameters(optimizer, owned, float(ADAMW_BYTES * rest), shape.params, compute)
    matrices = list(shape.matrices)
    others = shape.params - sum(r * c for r, c in matrices)
    owned = [float(FACTOR_BYTES * (r + c) + master * r * c) for r, c in matrices]
    owned += [float((FACTOR_BYTES + master) * n) for n in _other_tensors(shape, others)]
    return WholeParameters(optimizer, tuple(owned), 0.0, shape.params, None)


def _other_tensors(shape: ModelShape, others: int) -> list[int]:
    """The numels of the parameters that are not matrices: the tensors left over once each
    matrix's numel is taken out of the list once (one tensor of `others` if they don't add up)."""
    left = list(shape.tensor_numels)
    for r, c in shape.matrices:
        if r * c in left:
            left.remove(r * c)
    return left if sum(left) == others else ([others] if others else [])


def describe(whole: WholeParameters, rows, masters: bool) -> list[str]:
    """The lines under the table: the busiest owner per sharded row, and Muon's verdict."""
    lines = [
        f"{whole.optimizer}: whole parameters owned per shard group (optim column: the state "
        f"split evenly, {whole.state_bytes_per_param:.3g} bytes/parameter"
        f"{', fp32 masters of owned parameters included' if masters else ''})"
    ]
    for row in rows:
        strategy, size = row.candidate.strategy, row.candidate.shard_size
        if strategy not in ("zero1", "zero2", "zero3"):
            continue
        busiest, even, owners = whole.per_rank(size)
        lines.append(
            f"  {row.candidate.label}: busiest owner {busiest / 1e9:.4g} GB of optimizer state, "
            f"even split {even / 1e9:.4g} GB (imbalance {busiest / even if even else 1.0:.3g}x"
            f", {owners.idle} of {size} ranks own nothing)"
        )
    if whole.muon is not None:
        lines.append(whole.muon.verdict())
    return lines

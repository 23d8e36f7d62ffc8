"""The planner's whole-parameter ownership and Muon's compute ([Note: owner imbalance],
[Note: Muon's compute] in plan/ownership.py): pure arithmetic, no process group."""

from __future__ import annotations

import pytest
import torch

from dataparallel.plan import PlanError
from dataparallel.plan.model import ModelShape, builtin_shape
from dataparallel.plan.ownership import (
    assign_owners,
    muon_compute,
    muon_matrices,
    newton_schulz_flops,
    optimizer_memory,
)


def _square_model(d: int, k: int, vocab: int = 0) -> ModelShape:
    """k d x d matrices (between an embedding and a head when `vocab`)."""
    ends = ((vocab, d),) if vocab else ()
    matrices = ends + ((d, d),) * k + ends
    numels = tuple(r * c for r, c in matrices)
    return ModelShape(
        name="squares", params=sum(numels), tensor_numels=numels, matrices=matrices,
        units=(numels,), layers=k, width=d, seq_len=1, vocab=vocab,
        flops_per_token=6.0 * d * d * k + (6.0 * vocab * d if vocab else 0.0),
        activation_bytes=0.0, largest_activation=0.0,
    )  # fmt: skip


def test_owners_are_balanced_largest_first():
    owners = assign_owners([5, 4, 3, 3, 1], ranks=2)
    assert owners.loads == (8, 8) and owners.imbalance == 1.0 and owners.idle == 0
    few = assign_owners([10, 1], ranks=4)  # more ranks than parameters: most own nothing
    assert few.loads == (10, 1, 0, 0) and few.idle == 2
    assert few.imbalance == pytest.approx(10 / (11 / 4))
    with pytest.raises(PlanError, match="ranks"):
        assign_owners([1], ranks=0)


@pytest.fixture(scope="module")
def llama():
    return builtin_shape("llama-8b", 4096, torch.bfloat16, None)


def test_the_busiest_owner_holds_at_least_the_largest_parameter(llama):
    """The issue's figure: llama-8b's 4096 x 14336 MLP matrix on one owner of 4,096 ranks."""
    shape = llama
    memory = optimizer_memory(shape.tensor_numels, ranks=4096, bytes_per_element=12)
    mlp = 4096 * 14336
    assert max(shape.tensor_numels) >= mlp
    assert memory.owner_bytes >= mlp * 12 > 0.7e9  # 0.70 GB on its owner
    assert memory.flat_bytes == pytest.approx(shape.params * 12 / 4096, rel=1e-3)  # ~23 MB
    assert memory.imbalance > 20 and memory.ownership.idle > 0
    few = optimizer_memory(shape.tensor_numels, ranks=8, bytes_per_element=12)
    assert few.imbalance < 1.1  # many more parameters than ranks: nearly flat


def test_newton_schulz_is_five_d_over_b_of_a_square_matrix():
    d = 1024
    assert newton_schulz_flops(d, d) == 30 * d**3
    assert newton_schulz_flops(d, 4 * d) == newton_schulz_flops(4 * d, d) == 5 * 18 * d**3
    shape = _square_model(d, k=8)
    for tokens in (5 * d, 50 * d):
        one = muon_compute(shape, tokens_per_step=tokens, ranks=1)
        assert one.distributed_share == pytest.approx(5 * d / tokens)
        four = muon_compute(shape, tokens_per_step=tokens, ranks=4)  # 2 matrices per owner
        assert four.distributed_share == pytest.approx(5 * d / tokens)
        assert four.ddp_share == pytest.approx(4 * 5 * d / tokens)  # every rank, every matrix
    at_the_edge = muon_compute(shape, tokens_per_step=5 * d, ranks=4)
    assert "dominates the step (distributed and DDP)" in at_the_edge.verdict()
    bigger = muon_compute(shape, tokens_per_step=10 * d, ranks=4)
    assert "dominates the step (DDP)" in bigger.verdict()  # 0.5x distributed, 2x under DDP
    assert "does not dominate" in muon_compute(shape, 50 * d, ranks=1).verdict()
    with pytest.raises(PlanError, match="tokens_per_step"):
        muon_compute(shape, tokens_per_step=0, ranks=1)


def test_muon_leaves_the_embeddings_and_the_head_to_adamw(llama):
    shape = _square_model(64, k=3, vocab=1000)
    assert muon_matrices(shape) == [(64, 64)] * 3
    byte_level = _square_model(64, k=3, vocab=64)  # the vocabulary as wide as the model
    assert muon_matrices(byte_level) == [(64, 64)] * 3  # first and last left out
    kept = muon_matrices(llama)
    assert len(kept) == len(llama.matrices) - 2  # tok_embeddings and output
    # llama-8b at a 4M-token batch: about 5 d / B with d = 4096, a few per cent of the step
    share = muon_compute(llama, tokens_per_step=4 * 2**20, ranks=64).distributed_share
    assert 0.001 < share < 0.05

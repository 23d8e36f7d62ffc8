"""No gradient held twice: a parameter larger than a bucket, on a real two-rank run and in the
dry run of the issue's model ([Note: launched at the next hook] in strategies/parts/reducer.py).

Each bucket's last gradient used to be stored by autograd beside its bucket until the round's
end; a parameter larger than a bucket is alone in its own, so its whole gradient was held
twice at the end of the backward. Measured here by the bytes of CPU storages alive at once
(`LiveBytes(device="cpu")`, [Note: meta peak] in plan/live_bytes.py) during the second step's
forward and backward. The theory: what the rank holds (`dp.memory_report`) plus the backward's
transient bytes, measured on one process without the engine whose gradients stay allocated
(`zero_grad(set_to_none=False)`, as DDP's buckets do). Before the change DDP's peak was 508 kB
over it (the head's gradient, the last of its bucket), ZeRO-1's 1.56 MB and ZeRO-2's 3.67 MB (its
two buckets in flight at the peak, 2 MiB, are not in the theory: the planner does not count
them either, docs/plan.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.plan.dry_run import dry_run
from dataparallel.plan.live_bytes import LiveBytes

from .harness import run_world

VOCAB, WIDTH, TOKENS = 4096, 64, 16  # the embedding and the head: 1 MiB each, 4 buckets
BUCKET_MB = 0.25
POLICIES = {"ddp": dp.DDP, "zero1": dp.ZeRO1, "zero2": dp.ZeRO2}


@pytest.fixture(autouse=True)
def no_world_left():
    """The dry run starts its fake group in this process: a world an earlier module left goes."""
    dp.destroy()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.embed(x))))


def _measure(strategy: str | None, rank: int, world: int) -> tuple[int, int]:
    """(the peak of CPU storages alive during step 2's forward and backward, the bytes the
    rank holds: parameters, gradients, optimizer state and masters)."""
    mode = LiveBytes(device="cpu")
    with mode:
        torch.manual_seed(0)
        model = Net()
        if strategy is None:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            model = dp.parallelize(model, POLICIES[strategy](bucket_mb=BUCKET_MB))
            optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, VOCAB, (2 * world, TOKENS), generator=g)[2 * rank : 2 * rank + 2]
            mode.measuring = step == 1
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
            loss.backward()
            mode.measuring = False
            optimizer.step()
            optimizer.zero_grad(set_to_none=strategy is not None)
    if strategy is None:
        state = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
        held = sum(t.nbytes for t in [*model.parameters(), *state])
        held += sum(p.grad.nbytes for p in model.parameters())
    else:
        held = sum(dp.memory_report(model, optimizer).values())
    return mode.peak, held


def _ranks(world) -> dict:
    return {s: _measure(s, world.rank, world.world_size) for s in POLICIES}


def test_a_parameter_larger_than_a_bucket_is_held_once():
    plain_peak, plain_held = _measure(None, 0, 1)
    transient = plain_peak - plain_held  # the backward's activations and temporaries
    assert 1_500_000 < transient < 1_700_000, transient  # three logits-sized tensors: 1.57 MB
    measured = run_world(2, _ranks)
    cases = 0
    for rank, found in enumerate(measured):
        for strategy, (peak, held) in found.items():
            over = peak - (held + transient)
            print(f"rank {rank} {strategy}: peak {peak} B, theory {held + transient} B, {over:+} B")
            if strategy == "zero2":  # its buckets in flight, not in the theory: two of 1 MiB
                assert 2 * 2**20 <= over <= 2 * 2**20 + 4096, (rank, strategy, over)
            else:
                assert abs(over) <= 1024, (rank, strategy, over)
            cases += 1
    assert cases == 6


def test_the_dry_run_of_a_1b_llama_peaks_at_the_plan():
    """The issue's model: Llama 3.2 1B's shape, its embedding of 128,256 x 2,048 in bf16 (525
    MB) far larger than a 25 MB bucket; bf16 parameters with fp32 masters, AdamW, rank 0 of 2.
    ZeRO-1 peaks in the backward, within 0.1% of the plan (+9.9% before: 1.61 GB of autograd's
    gradients beside the buckets); DDP, with that gone, peaks in the optimizer step, whose
    temporaries the plan does not count (two fp32 tensors of the largest bucket: +2.1%)."""
    cases = 0
    for strategy, (low, high) in {"ddp": (1.015, 1.025), "zero1": (0.999, 1.002)}.items():
        result = dry_run("llama-1b", ranks=2, strategy=strategy, precision="bf16-params",
                         seq_len=64, roles=[0])  # fmt: skip
        run = result.runs[0]
        assert low < run.peak / result.row.peak_bytes < high, (strategy, run.peak_terms)
        assert "backward (engine)" not in run.peak_terms  # no gradient buffer in flight
        assert run.peak_terms.get("backward", 0) < 1_600_000_000, run.peak_terms
        cases += 1
    assert cases == 2

"""What a step puts on the wire, counted by `Comm` from each collective's algorithm: an int8
reduction (all-to-all + all-gather of quantised chunks) puts about a quarter of fp32 DDP's
ring all-reduce bytes on the wire, where the payload count said 1/2.65."""

from __future__ import annotations

import torch
from torch.nn import functional as F

import dataparallel as dp

from .harness import run_world
from dataparallel.models import GPT, GPTConfig


def _world(world, compress):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64))
    policy = dp.DDP(comm_hook=dp.compression.build_hook(compress)) if compress else "ddp"
    dp.parallelize(model, policy)
    optimizer = dp.build_optimizer(model, torch.optim.SGD, lr=0.1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(world.rank))
    before = dp.bytes_sent(model), dp.wire_bytes(model)
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    return dp.bytes_sent(model) - before[0], dp.wire_bytes(model) - before[1], params


def test_int8_puts_a_quarter_of_fp32s_bytes_on_the_wire():
    fp32 = run_world(2, _world, "")
    int8 = run_world(2, _world, "int8")
    (payload, wire, params), (payload8, wire8, _) = fp32[0], int8[0]
    # 2 (k-1)/k x 4n at k = 2, and the end of backward's few flags
    assert 4 * params <= wire == payload < 4 * params + 256
    assert 3.9 < wire / wire8 < 4.0, wire / wire8
    assert 2.6 < payload / payload8 < 2.7, payload / payload8  # what the payload count said

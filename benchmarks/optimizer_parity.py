"""Optimizers that are not elementwise against one process on the global batch, every strategy
(issue 29; docs/optimizers.md).

    python benchmarks/optimizer_parity.py --model gpt-tiny --steps 5

One world of `--nproc` ranks (gloo, one thread each). Each rank trains a fresh model per
strategy and optimizer on its slice of a global batch; rank 0 also trains one process on the
whole batch. The table gives max |parameter - one process| after `--steps` steps, and how far
the one-process parameters moved in all. "lamb-flat" is the test's LAMB-style optimizer
declared elementwise (`elementwise=True`, the flat shards every optimizer had before): its
trust ratio is then taken per flat piece.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from contenders import MODELS, bench_model
from torch.nn import functional as F

import dataparallel as dp


class Lamb(torch.optim.Optimizer):
    """Momentum SGD with a per-parameter trust ratio ||w|| / ||update|| (tests/dist/test_owners.py)."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                w, u = p.norm(), update.norm()
                ratio = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                p.sub_(group["lr"] * ratio * update)


OPTIMIZERS = {
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "lamb": (Lamb, {"lr": 0.05}),
    "lamb-flat": (Lamb, {"lr": 0.05, "elementwise": True}),
}


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def run_rank(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc))  # fmt: skip
    dp.init(backend="gloo", threads=1)
    n, seq = args.nproc, min(MODELS[args.model].block_size, 64)
    gen = torch.Generator().manual_seed(1000)
    data = torch.randint(0, 256, (args.steps, args.batch * n, seq + 1), generator=gen)
    result = {}
    for opt_name in args.optimizers:
        cls, kwargs = OPTIMIZERS[opt_name]
        plain = {k: v for k, v in kwargs.items() if k != "elementwise"}
        torch.manual_seed(0)
        reference = bench_model(args.model)
        start = {k: v.clone() for k, v in reference.state_dict().items()}
        ref_opt = cls(reference.parameters(), **plain)
        for tokens in data:
            torch.stack([loss_of(reference, c) for c in tokens.chunk(n)]).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        final = reference.state_dict()
        row = {"moved": max((final[k] - v).abs().max().item() for k, v in start.items())}
        for name in args.strategies:
            torch.manual_seed(0)
            model = dp.parallelize(bench_model(args.model), name)
            opt = dp.build_optimizer(model, cls, **kwargs)
            for tokens in data:
                loss_of(model, tokens.chunk(n)[rank]).backward()
                opt.step()
                opt.zero_grad()
            full = dp.full_state_dict(model)
            row[name] = max((full[k] - v).abs().max().item() for k, v in final.items())
        result[opt_name] = row
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dp.destroy()
    sys.stdout.flush()
    os._exit(0)  # [Note: teardown] in bench_step.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny", choices=list(MODELS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3")
    parser.add_argument("--optimizers", default="adafactor,lamb,lamb-flat")
    args = parser.parse_args()
    args.strategies = args.strategies.split(",")
    args.optimizers = args.optimizers.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(run_rank, args=(args, dp.free_port(), out), nprocs=args.nproc, join=True)
        measured = json.loads(Path(out).read_text())
    print(f"{args.model}, {args.nproc} ranks, {args.batch} x {min(MODELS[args.model].block_size, 64)}"
          f" tokens per rank, {args.steps} steps: max |param - one process|")  # fmt: skip
    print("\n| optimizer | " + " | ".join(args.strategies) + " | moved in all |")
    print("|---|" + "--:|" * (len(args.strategies) + 1))
    for opt_name, row in measured.items():
        cells = " | ".join(f"{row[s]:.1e}" for s in args.strategies)
        print(f"| {opt_name} | {cells} | {row['moved']:.1e} |")


if __name__ == "__main__":
    main()

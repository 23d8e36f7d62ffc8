"""Optimizers that are not elementwise against one process on the global batch, every strategy
(issues 29 and 38; docs/optimizers.md).

    python benchmarks/optimizer_parity.py --model gpt-tiny --steps 10

One world of `--nproc` ranks (gloo, one thread each). Each rank trains a fresh model per
strategy and optimizer on its slice of a global batch; rank 0 also trains one process on the
whole batch; "torch-ddp" is PyTorch's DDP with the plain class, the peer whose numerics ours
should equal (gpt-tiny's attention key bias has an exactly zero true gradient whose rounding
noise an Adam-like normalization turns into lr-sized steps, so chunked and whole-batch runs of
Adam-family classes differ by about lr even in one process). The table gives max |parameter -
one process| after `--steps` steps, how far the
one-process parameters moved in all, and for optimizers that keep a step-size statistic in
their first group (Prodigy's `d`) its relative difference from one process's, on rank 0.
"lamb" is the test's LAMB-style optimizer undeclared (the exact default: one owner), "lamb-
param" declared `reads="parameter"` (balanced owners, right for it), "lamb-flat" declared
elementwise (wrong: its trust ratio is taken per flat piece). "prodigy" is pytorch_optimizer's
(its d sums over every parameter) undeclared, "prodigy-param" declared `reads="parameter"`
(wrong: each owner's d over its own parameters, what every unknown class got before issue 38).
"schedulefree" steps AdamWScheduleFree and compares the eval-mode weights after
`optimizer.eval()`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from contenders import MODELS, bench_model
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

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


def _prodigy():
    from pytorch_optimizer import Prodigy  # the dev extra's

    return Prodigy


def _ecosystem(name: str):
    def make():
        import pytorch_optimizer

        return getattr(pytorch_optimizer, name)

    return make


def _installed(module: str, name: str):
    def make():
        import importlib

        return getattr(importlib.import_module(module), name)

    return make


def _schedule_free():
    from schedulefree import AdamWScheduleFree

    return AdamWScheduleFree


OPTIMIZERS = {  # name -> (class, its arguments, what is declared at build_optimizer)
    "adafactor": (lambda: torch.optim.Adafactor, {"lr": 1e-2}, {}),
    "lamb": (lambda: Lamb, {"lr": 0.05}, {}),
    "lamb-param": (lambda: Lamb, {"lr": 0.05}, {"reads": "parameter"}),
    "lamb-flat": (lambda: Lamb, {"lr": 0.05}, {"elementwise": True}),
    "prodigy": (_prodigy, {"lr": 3.0}, {}),
    "prodigy-param": (_prodigy, {"lr": 3.0}, {"reads": "parameter"}),
    "schedulefree": (_schedule_free, {"lr": 1e-2, "warmup_steps": 2}, {}),
    # pytorch_optimizer's, undeclared (one owner) and declared as what their step reads
    "po-lion": (_ecosystem("Lion"), {"lr": 1e-4}, {}),
    "po-lion-elementwise": (_ecosystem("Lion"), {"lr": 1e-4}, {"elementwise": True}),
    "po-lamb": (_ecosystem("Lamb"), {"lr": 1e-2}, {}),
    "po-lamb-param": (_ecosystem("Lamb"), {"lr": 1e-2}, {"reads": "parameter"}),
    "po-soap": (_ecosystem("SOAP"), {"lr": 3e-3}, {}),
    "po-soap-param": (_ecosystem("SOAP"), {"lr": 3e-3}, {"reads": "parameter"}),
    # torchao's 8-bit AdamW (blocks of 256 elements within a parameter) and heavyball's SOAP,
    # when installed (not the dev extra's)
    "torchao-adamw8bit": (_installed("torchao.optim", "AdamW8bit"), {"lr": 1e-3}, {}),
    "torchao-adamw8bit-param": (
        _installed("torchao.optim", "AdamW8bit"),
        {"lr": 1e-3},
        {"reads": "parameter"},
    ),
    "heavyball-soap": (_installed("heavyball", "SOAP"), {"lr": 3e-3}, {}),
    "heavyball-soap-param": (_installed("heavyball", "SOAP"), {"lr": 3e-3}, {"reads": "parameter"}),
}
STATISTIC = {"prodigy": "d", "prodigy-param": "d"}


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model, opt, data, n: int, rank: int | None) -> None:
    """The steps on the global batch (rank None: one process) or this rank's slice of it;
    schedule-free's `train()` before and `eval()` after (the weights compared are eval's)."""
    if hasattr(opt, "eval"):
        opt.train()
    for tokens in data:
        if rank is None:
            torch.stack([loss_of(model, c) for c in tokens.chunk(n)]).mean().backward()
        else:
            loss_of(model, tokens.chunk(n)[rank]).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "eval"):
        opt.eval()


def run_rank(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc))  # fmt: skip
    dp.init(backend="gloo", threads=1)
    n, seq = args.nproc, min(MODELS[args.model].block_size, 64)
    gen = torch.Generator().manual_seed(1000)
    data = torch.randint(0, 256, (args.steps, args.batch * n, seq + 1), generator=gen)
    result = {}
    for opt_name in args.optimizers:
        make, kwargs, declared = OPTIMIZERS[opt_name]
        cls = make()
        torch.manual_seed(0)
        reference = bench_model(args.model)
        start = {k: v.clone() for k, v in reference.state_dict().items()}
        ref_opt = cls(reference.parameters(), **kwargs)
        train(reference, ref_opt, data, n, None)
        final = reference.state_dict()
        row = {"moved": max((final[k] - v).abs().max().item() for k, v in start.items())}
        key = STATISTIC.get(opt_name)
        for name in args.strategies:
            torch.manual_seed(0)
            if name == "torch-ddp":  # PyTorch's DDP with the plain class: the peer's numerics
                model = DistributedDataParallel(bench_model(args.model))
                opt = cls(model.parameters(), **kwargs)
                train(model, opt, data, n, rank)
                full = model.module.state_dict()
            else:
                model = dp.parallelize(bench_model(args.model), name)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the unknown class's one line
                    opt = dp.build_optimizer(model, cls, **kwargs, **declared)
                train(model, opt, data, n, rank)
                full = dp.full_state_dict(model)
            row[name] = max((full[k] - v).abs().max().item() for k, v in final.items())
            if key is not None:
                got, want = opt.param_groups[0][key], ref_opt.param_groups[0][key]
                row[name + " stat"] = abs(float(got) - float(want)) / abs(float(want))
        if key is not None:
            row["stat"] = float(ref_opt.param_groups[0][key])
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
    parser.add_argument("--strategies", default="torch-ddp,ddp,zero1,zero2,zero3")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = parser.parse_args()
    args.strategies = args.strategies.split(",")
    args.optimizers = args.optimizers.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(run_rank, args=(args, dp.free_port(), out), nprocs=args.nproc, join=True)
        measured = json.loads(Path(out).read_text())
    print(f"{args.model}, {args.nproc} ranks, {args.batch} x {min(MODELS[args.model].block_size, 64)}"
          f" tokens per rank, {args.steps} steps: max |param - one process|")  # fmt: skip
    print("\n| optimizer | " + " | ".join(args.strategies) + " | moved in all | statistic |")
    print("|---|" + "--:|" * (len(args.strategies) + 2))
    for opt_name, row in measured.items():
        cells = " | ".join(f"{row[s]:.1e}" for s in args.strategies)
        stat = (
            ""
            if "stat" not in row
            else f"d {row['stat']:.3g}; off on rank 0: "
            + ", ".join(f"{s} {row[s + ' stat']:.1e}" for s in args.strategies)
        )
        print(f"| {opt_name} | {cells} | {row['moved']:.1e} | {stat} |")


if __name__ == "__main__":
    main()

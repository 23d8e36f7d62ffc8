"""Can compiled autograd carry the gradient reductions? Ours eager against three compiled forms.

    python benchmarks/compiled_reduction.py                    # gpt-deep-narrow, 2 ranks, gloo
    python benchmarks/compiled_reduction.py --steps 20 --warmup 5

Contenders, each on a fresh copy of the same model, fp32 AdamW, one world of `--nproc` ranks:
- `ddp`: our DDP, eager (the reducer of [Note: attached views] in strategies/parts/reducer.py);
- `ddp+compile`: our DDP over the model compiled by `torch.compile` (forward and its AOT
  backward compiled, the reducer's hooks outside the graphs: [Note: compile] in zero3/strategy.py);
- `compiled-autograd`: no engine; each parameter's post-accumulate-grad hook all-reduces its
  gradient with a functional collective (`_functional_collectives.all_reduce`), the model is
  compiled and `loss.backward()` runs under compiled autograd, so the hooks are traced into the
  backward graph and inductor buckets the all-reduces (`bucket_all_reduces_fx = "all"`);
- `torch-ddp+ca`: PyTorch's DDP with `torch._dynamo.config.optimize_ddp = "python_reducer"`
  under compiled autograd, its documented way of tracing the reduction.
Each is timed for `--steps` steps after `--warmup` (the compiles happen there); the table gives
the median step time and the largest difference of any parameter from `ddp`'s after the same
steps on the same batches. What compiled autograd cannot do and the engine does (unused
parameters detected each step, `no_sync`, communication hooks, live recovery) is in
docs/ddp.md, "Compiled autograd".
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from contenders import bench_model, lm_loss

import dataparallel as dp

CONTENDERS = ("ddp", "ddp+compile", "compiled-autograd", "torch-ddp+ca")


def traced_hooks(model, world: int) -> None:
    """The per-parameter reduction compiled autograd traces (no Python state across hooks)."""
    group = dist.group.WORLD

    def hook(param):
        param.grad = funcol.all_reduce(param.grad / world, "sum", group)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(hook)


def setup(name: str, model, world: int):
    """(module to call, optimizer, whether backward runs under compiled autograd)."""
    if name.startswith("ddp"):
        dp.parallelize(model, "ddp")
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=3e-4)
        return (torch.compile(model) if name == "ddp+compile" else model), optimizer, False
    if name == "compiled-autograd":
        traced_hooks(model, world)
        return torch.compile(model), torch.optim.AdamW(model.parameters(), lr=3e-4), True
    torch._dynamo.config.optimize_ddp = "python_reducer"
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    return torch.compile(wrapped), torch.optim.AdamW(model.parameters(), lr=3e-4), True


def run(name: str, args, rank: int, world: int) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = bench_model(args.model)
    module, optimizer, compiled_backward = setup(name, model, world)
    generator = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, 256, (args.batch, 33), generator=generator) for _ in range(4)]
    engine = torch.compile(backend="inductor")
    times = []
    for step in range(args.warmup + args.steps):
        tokens = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(module, tokens[:, :-1], tokens[:, 1:])
        if compiled_backward:
            with torch._dynamo.compiled_autograd._enable(engine):
                loss.backward()
        else:
            loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, [p.detach().clone() for p in model.parameters()]


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch._inductor.config.bucket_all_reduces_fx = "all"
    torch._dynamo.config.cache_size_limit = 64
    rows, reference = [], None
    for name in args.contenders:
        try:
            ms, params = run(name, args, rank, world)
        except Exception as error:  # a contender that cannot run says why, in its row
            rows.append((name, None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"))
            continue
        reference = params if reference is None else reference
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference, strict=True))
        rows.append((name, ms, f"{diff:.1e}"))
        dist.barrier()
    if rank == 0:
        print(f"- command: `python benchmarks/compiled_reduction.py {' '.join(sys.argv[1:])}`")
        print(f"- torch {torch.__version__}; {args.model}, {world} ranks x 1 thread, gloo; "
              f"median of {args.steps} steps after {args.warmup}\n")  # fmt: skip
        print("| contender | median step ms | vs ddp | max parameter difference from ddp |")
        print("|---|--:|--:|---|")
        base = rows[0][1] if rows and rows[0][1] else None
        for name, ms, note in rows:
            ratio = f"{ms / base:.3f}x" if ms and base else "-"
            print(f"| {name} | {'-' if ms is None else f'{ms:.1f}'} | {ratio} | {note} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-deep-narrow")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    args.contenders = args.contenders.split(",")
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()

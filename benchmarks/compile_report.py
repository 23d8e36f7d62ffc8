"""What torch.compile makes of each strategy: graphs, graph breaks, and parity with one process.

    python benchmarks/compile_report.py --model gpt-deep-narrow --nproc 2

For every strategy (ours and the compute-only bound) and every way to compile (the whole
model before `parallelize`, after it, or each block), a fresh model from one seed trains
`--steps` AdamW steps on 2 ranks; rank 0 prints the graphs the compiler made, its graph breaks
(counted by torch._dynamo), and the largest difference of the final weights from one process
trained eagerly on the global batch. Step times compiled against eager are bench_step.py's
`<name>-compiled` contenders.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch._dynamo as dynamo
import torch.multiprocessing as mp
from bench_step import free_port, join_world
from contenders import LR, MODELS, bench_model, lm_loss

import dataparallel as dp

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ORDERS = ("before", "after", "block")


def train(model, optimizer, batches) -> None:
    for x, y in batches:
        lm_loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def one(strategy: str, order: str, args, world, batches, everyone) -> dict:
    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(args.seed)
    model = bench_model(args.model)
    reference = copy.deepcopy(model)
    if order == "before":
        compiled = torch.compile(model)
        dp.parallelize(model, strategy, group=world.group)
    elif order == "after":
        dp.parallelize(model, strategy, group=world.group)
        compiled = torch.compile(model)
    else:
        dp.parallelize(model, strategy, group=world.group)
        for block in model.blocks:
            block.compile()
        compiled = model
    train(compiled, dp.build_optimizer(model, torch.optim.AdamW, lr=LR), batches)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=LR), everyone)
    full, plain = dp.full_state_dict(model), reference.state_dict()
    # A break dynamo resumes after counts in "graph_break"; one it handles by running a hook
    # (or a whole frame) eagerly counts in "unimplemented": both are breaks here.
    breaks = {**dynamo.utils.counters["graph_break"], **dynamo.utils.counters["unimplemented"]}
    return {
        "graphs": dynamo.utils.counters["stats"]["unique_graphs"],
        "breaks": sum(breaks.values()),
        "reasons": sorted({reason.strip().splitlines()[0] for reason in breaks}),
        "diff": max((full[k] - v).abs().max().item() for k, v in plain.items()),
    }


def run_rank(rank: int, args, port: int) -> None:
    world = join_world(rank, args, port)
    vocab, seq = MODELS[args.model].vocab_size, min(MODELS[args.model].block_size, 256)
    g = torch.Generator().manual_seed(args.seed)
    everyone = [
        (torch.randint(0, vocab, (args.batch * args.nproc, seq), generator=g),) * 2
        for _ in range(args.steps)
    ]
    everyone = [(x, torch.roll(x, -1, dims=1)) for x, _ in everyone]
    mine = [(x.chunk(args.nproc)[rank], y.chunk(args.nproc)[rank]) for x, y in everyone]
    rows = [(s, o, one(s, o, args, world, mine, everyone)) for s in STRATEGIES for o in ORDERS]
    if rank == 0:
        print(
            f"{args.model}, {args.nproc} ranks, {args.steps} AdamW steps, torch {torch.__version__}"
        )
        print("| strategy | compiled | graphs | graph breaks | max diff from one process |")
        print("|---|---|--:|--:|--:|")
        for strategy, order, r in rows:
            where = {"before": "whole, before parallelize", "after": "whole, after"}.get(
                order, "each block"
            )
            print(f"| {strategy} | {where} | {r['graphs']} | {r['breaks']} | {r['diff']:.1e} |")
        reasons = sorted({reason for _, _, r in rows for reason in r["reasons"]})
        print("graph-break reasons:", "; ".join(reasons) or "none")
        print("(a frame whose loop holds a break runs eagerly and the blocks it calls compile")
        print(" as frames of their own: `graphs` counts distinct graphs, one per code object)")
    dp.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny", choices=sorted(MODELS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.baseline_path = None
    mp.spawn(run_rank, args=(args, free_port()), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()

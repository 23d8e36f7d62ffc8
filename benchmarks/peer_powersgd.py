"""The peer for the slow-link benchmark: PyTorch DDP with its `powerSGD_hook`, trained on our
data, model, optimizer and schedule, so that only the data-parallel engine differs.

    torchrun --nproc-per-node 2 benchmarks/peer_powersgd.py --steps 200 --out runs/peer

Same as `dataparallel train --model gpt-small --compress powersgd:rank=4,start=10` with the
defaults (batch 16 x 128 tokens per rank, AdamW lr 2e-3, 30 warm-up steps, cosine, clip 1.0,
seed 1337, the built-in corpus), including the loss normalisation ([Note: loss normalisation]
in train/trainer.py). Bytes per step come from the hook's own compression statistics (the
elements it all-reduced, at 4 bytes each). Rank 0 writes OUT/peer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn import functional as F

from dataparallel.data import DistributedSampler
from dataparallel.data.corpus import TokenWindows, evenly_spaced, load_corpus
from dataparallel.models import build_model
from dataparallel.train.lr_schedule import WarmupCosine
from dataparallel.train.trainer import next_indices, param_groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--start", type=int, default=10)
    parser.add_argument("--out", default="runs/peer")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_tokens, val_tokens = load_corpus([]).split(0.05)
    train, val = TokenWindows(train_tokens, 128), TokenWindows(val_tokens, 128)
    torch.manual_seed(1337)
    model = torch.nn.parallel.DistributedDataParallel(build_model("gpt-small"))
    state = torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=args.start
    )
    model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    optimizer = torch.optim.AdamW(param_groups(model.module, 0.1), lr=2e-3, betas=(0.9, 0.95))
    schedule = WarmupCosine(warmup_steps=30, total_steps=args.steps, min_ratio=0.1)
    sampler = DistributedSampler(len(train), rank=rank, world_size=world, seed=1337, shuffle=True)
    times, sent = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        before = state.total_numel_after_compression if step >= args.start else 0
        inputs, targets = train.batch(next_indices(sampler, 16))
        for group in optimizer.param_groups:
            group["lr"] = 2e-3 * schedule(step)
        logits = model(inputs)
        summed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        (summed / targets.numel()).backward()  # equal token counts: the same normalisation
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        if step >= args.start:
            sent.append(4 * (state.total_numel_after_compression - before))
    loss, tokens = _evaluate(model.module, val, rank, world)
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        result = {
            "steps": args.steps,
            "train_time_s": sum(times),
            "step_time_median_s": statistics.median(times[2:]),
            "bytes_sent_per_step_compressed": statistics.median(sent) if sent else 0,
            "val_loss": loss,
            "val_tokens": tokens,
        }
        (Path(args.out) / "peer.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
    dist.destroy_process_group()


@torch.no_grad()
def validation_sums(model, val: TokenWindows, rank: int, world: int) -> tuple[float, int]:
    """Our trainer's validation: the same 256 evenly spaced windows, rank r scoring r, r +
    world, ...; this rank's (summed token loss, tokens)."""
    chosen = evenly_spaced(256, len(val))[rank::world]
    loss, tokens = 0.0, 0
    for first in range(0, len(chosen), 16):
        inputs, targets = val.batch(chosen[first : first + 16])
        logits = model(inputs)
        loss += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
        tokens += targets.numel()
    return loss, tokens


def _evaluate(model, val: TokenWindows, rank: int, world: int) -> tuple[float, int]:
    total = torch.tensor(validation_sums(model, val, rank, world), dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1]), int(total[1])


if __name__ == "__main__":
    main()

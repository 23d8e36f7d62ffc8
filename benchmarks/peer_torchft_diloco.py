"""The DiLoCo peer for the slow-link benchmark: torchft's `DiLoCo`, one replica group of one
rank per host, trained on our data, model, optimizer and schedule.

    python benchmarks/peer_torchft_diloco.py --replica 0 --address 127.0.0.1 --lighthouse-host &
    python benchmarks/peer_torchft_diloco.py --replica 1 --address 127.0.0.1 --lighthouse 127.0.0.1

Same as `dataparallel train --model gpt-small --diloco 50` with fp32 outer gradients (torchft's
quantisation needs CUDA): batch 16 x 128 tokens per replica, AdamW lr 2e-3 with 30 warm-up
steps and cosine, clip 1.0, seed 1337, outer Nesterov SGD lr 0.7 momentum 0.9. Replica 0 runs
torchft's lighthouse; each replica has its own TCPStore and torchft Manager. Replica 0 writes
OUT/peer.json. Needs `pip install torchft` (not a dependency of ours).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from peer_powersgd import validation_sums  # this folder is on sys.path when run as a script
from torch.nn import functional as F

from dataparallel.data import DistributedSampler
from dataparallel.data.corpus import TokenWindows, load_corpus
from dataparallel.models import build_model
from dataparallel.train.lr_schedule import WarmupCosine
from dataparallel.train.trainer import next_indices, param_groups

LIGHTHOUSE_PORT = 29510


def main() -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo

    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--address", required=True, help="this host's address")
    parser.add_argument("--lighthouse", default="", help="the lighthouse host's address")
    parser.add_argument("--lighthouse-host", action="store_true", help="run the lighthouse")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--out", default="runs/peer-torchft")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lighthouse = None
    if args.lighthouse_host:
        lighthouse = LighthouseServer(bind=f"0.0.0.0:{LIGHTHOUSE_PORT}", min_replicas=2)
    where = args.address if args.lighthouse_host else args.lighthouse
    store = dist.TCPStore(args.address, 0, is_master=True, wait_for_workers=False)
    train_tokens, val_tokens = load_corpus([]).split(0.05)
    train, val = TokenWindows(train_tokens, 128), TokenWindows(val_tokens, 128)
    torch.manual_seed(1337)
    model = build_model("gpt-small")
    inner = torch.optim.AdamW(param_groups(model, 0.1), lr=2e-3, betas=(0.9, 0.95))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
        min_replica_size=2,
        use_async_quorum=False,
        load_state_dict=lambda s: (
            model.load_state_dict(s["model"]),
            inner.load_state_dict(s["inner"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=str(args.replica),
        store_addr=args.address,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=f"http://{where}:{LIGHTHOUSE_PORT}",
        port=19530 + args.replica,
        hostname=args.address,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=60),
    )
    schedule = WarmupCosine(warmup_steps=30, total_steps=args.steps, min_ratio=0.1)
    sampler = DistributedSampler(
        len(train), rank=args.replica, world_size=2, seed=1337, shuffle=True
    )
    times = []
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        for step in range(args.steps):
            started = time.perf_counter()
            inputs, targets = train.batch(next_indices(sampler, 16))
            for group in inner.param_groups:
                group["lr"] = 2e-3 * schedule(step)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            inner.step()  # DiLoCo's hook: every sync_every steps, the outer step
            inner.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
    loss, tokens = _evaluate(model, val, args.replica)
    result = {
        "steps": args.steps,
        "train_time_s": sum(times),
        "step_time_median_s": statistics.median(times[2:]),
        "val_loss_own_half": loss,
        "val_tokens": tokens,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"peer-{args.replica}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    manager.shutdown(wait=False)
    if lighthouse is not None:
        time.sleep(2)
        lighthouse.shutdown()


def _evaluate(model, val: TokenWindows, replica: int) -> tuple[float, int]:
    """This replica's half of our trainer's validation windows (the two halves' token-weighted
    mean is our trainer's validation loss)."""
    loss, tokens = validation_sums(model, val, replica, 2)
    return loss / tokens, tokens


if __name__ == "__main__":
    main()

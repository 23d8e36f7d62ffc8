"""Cost of one gloo collective on this machine: wall time and CPU time per rank.

    python benchmarks/bench_collective.py --numel 3290624 --repeats 30

Times gloo's all_reduce, reduce_scatter and all_gather of `--numel` fp32 elements between
`--nproc` ranks on 127.0.0.1 (one thread each), with nothing else running, and our pairwise
reduce_scatter and all_gather (point-to-point messages, [Note: pairwise collectives] in
comm/pairwise.py) on the same buffers, and prints the medians. This is the floor that
communication adds to a step when every core is busy computing (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataparallel.comm import Comm


def measure(fn, repeats: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3


def worker(rank: int, world_size: int, port: int, numel: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    full = torch.randn(numel - numel % world_size)
    shard = torch.empty(full.numel() // world_size)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pairwise = Comm(pairwise=True)
    cases = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: scatter(shard, full),
        "all_gather": lambda: gather(full, shard),
        "pairwise reduce_scatter": lambda: pairwise.reduce_scatter(shard, full),
        "pairwise all_gather": lambda: pairwise.all_gather(full, shard),
    }
    for name, fn in cases.items():
        wall, cpu = measure(fn, repeats)
        if rank == 0:
            mb = full.numel() * 4 / 1e6
            print(f"{name:23s} {mb:6.1f} MB  wall {wall:6.1f} ms  cpu {cpu:6.1f} ms (rank 0)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=3_290_624, help="fp32 elements (gpt-small)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args.numel, args.repeats), nprocs=args.nproc)


if __name__ == "__main__":
    main()

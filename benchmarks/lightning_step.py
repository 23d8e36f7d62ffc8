"""The Lightning strategy's step against the API's step on the same model (issue 41, item 3).

    python benchmarks/lightning_step.py --strategies ddp,zero2,zero3 --rounds 4 --steps 15 [--model gpt-small]

One world of 2 CPU ranks (gloo). Each round runs, for every strategy, the two contenders one
after the other on the same model, data and settings (AdamW, a warm-up scheduler, clip 1.0):
- "api": `dp.compose` and a hand-written loop (forward, backward, `dp.clip_grad_norm_`,
  `optimizer.step()`, `scheduler.step()`, `zero_grad`);
- "api-between": the same loop clearing the gradients between the forward and the backward,
  as Lightning's closure does;
- "lightning": `Trainer(strategy=DataParallelStrategy(name))` over the same LightningModule
  (progress bar, logger, checkpoints and summary off).
A step's time is the wall time between two consecutive optimizer steps' ends on rank 0 (the
first 3 of each run dropped: warm-up); the table gives medians over every round and the ratio
lightning / api. Beside it, the CPU time rank 0's process spent in the same interval
(`time.process_time`, every thread): the work each contender does a step, which the other
processes on the machine do not move the way they move wall time (on 2 cores, two ranks'
scheduling alone spreads wall-time medians by about 5%), and the minor page faults rank 0 took
in it (`faults/step`, medians, api / lightning): on CPU, glibc hands large freed blocks (ZeRO-3's
gathered parameters, ZeRO-2's gradients) back to the kernel and faults them in again when they
are next allocated, and how often it does so depends on what else the loop allocates. Run with
`MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=268435456` in the environment to keep
them in the process (faults/step then near 0 for both). Prints the table and writes it as JSON
(--out).

With many rounds, `paired` comes with a 95% interval: the geometric mean of the rounds' paired
ratios (lightning's median over api's in the same round) and the 2.5th and 97.5th percentiles
of that mean over 2,000 resamples of the rounds (a bootstrap, seeded); a bound such as "within
3%" is shown when the whole interval is inside it. `--kinds api,lightning` skips api-between.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch.nn import functional as F

VOCAB, BATCH, WARM = 256, 8, 3
# --model: (width, sequence) of a 4-layer GPT: the default's 65 ms step holds Lightning's own
# loop (about 2 ms a step) at 3%; gpt-small's (the built-in's shape, 2,048 tokens a rank) at <1%.
SIZES = {"4x128": (128, 64), "gpt-small": (256, 256)}


def module_class(size: tuple[int, int]):
    import lightning as L

    from dataparallel.models import GPT, GPTConfig

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            width, seq = size
            self.model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=width, block_size=seq))
            self.times: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.times.append(stamp())

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
            warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}

    return LitGPT


def loader(steps: int, size: tuple[int, int]):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2 * BATCH * steps, size[1] + 1), generator=g)
    data = torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def run_api(name: str, steps: int, size, between: bool = False) -> list[float]:
    import dataparallel as dp

    model = module_class(size)().model  # the same GPT, parallelized itself
    composed = dp.compose(model, dp.Recipe(strategy=name), torch.optim.AdamW, lr=1e-3)
    optimizer = composed.optimizer
    warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 10))
    dataset = loader(steps, size).dataset
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
    data = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    times = []
    for x, y in data:
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        if between:  # Lightning's order: the closure clears between forward and backward
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dp.clip_grad_norm_(model, 1.0)
        optimizer.step()
        warm.step()
        if not between:
            optimizer.zero_grad(set_to_none=True)
        times.append(stamp())
    return times


def run_lightning(name: str, steps: int, size) -> list[float]:
    import lightning as L

    from dataparallel.lightning import DataParallelStrategy

    module = module_class(size)()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DataParallelStrategy(name),
        max_epochs=1,
        gradient_clip_val=1.0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(steps, size))
    return module.times


def stamp() -> tuple[float, float, int]:
    """The wall clock, this process's CPU time and its minor page faults so far."""
    return (
        time.perf_counter(),
        time.process_time(),
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
    )


def intervals(times: list[tuple]) -> tuple[list[float], list[float], list[int]]:
    """Each step's wall time, rank 0's CPU time and page faults, the warm-up's dropped."""
    pairs = list(zip(times[WARM:-1], times[WARM + 1 :], strict=True))
    return tuple([b[i] - a[i] for a, b in pairs] for i in range(3))


def worker(rank: int, port: int, args, queue) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import dataparallel as dp

    dp.init()
    found: dict[str, dict[str, list]] = {}
    kinds = tuple(args.kinds.split(","))
    size = SIZES[args.model]
    for r in range(args.rounds):
        for name in args.strategies.split(","):
            row = found.setdefault(
                name,
                {
                    k: []
                    for k in (*kinds, *(f"{k} {m}" for k in kinds for m in ("cpu", "faults")))
                    + ("paired", "paired cpu")
                },
            )
            times = {}
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # who runs first rotates
                if kind == "lightning":
                    times[kind], cpu, faults = intervals(run_lightning(name, args.steps, size))
                else:
                    between = kind == "api-between"
                    times[kind], cpu, faults = intervals(run_api(name, args.steps, size, between))
                row[kind] += times[kind]
                row[f"{kind} cpu"] += cpu
                row[f"{kind} faults"] += faults
            row["paired"].append(
                statistics.median(times["lightning"]) / statistics.median(times["api"])
            )
            row["paired cpu"].append(
                statistics.median(row["lightning cpu"][-len(times["lightning"]) :])
                / statistics.median(row["api cpu"][-len(times["api"]) :])
            )
    if rank == 0:
        queue.put(found)
    dp.destroy()


def interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The geometric mean of `ratios` and its 95% bootstrap interval over resampled rounds."""
    logs = [math.log(r) for r in ratios]
    pick = random.Random(0)
    means = sorted(statistics.fmean(pick.choices(logs, k=len(logs))) for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(low), math.exp(high)


def show(found: tuple[float, float, float]) -> str:
    return f"{found[0]:.3f} [{found[1]:.3f}, {found[2]:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero2,zero3")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--model", choices=sorted(SIZES), default="4x128")
    parser.add_argument("--kinds", default="api,api-between,lightning")
    parser.add_argument("--out", default="lightning_step.json")
    args = parser.parse_args()
    import dataparallel as dp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = dp.free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    found = queue.get()
    for p in procs:
        p.join()
    table = {}
    print(
        f"{'strategy':10} {'api ms':>8} {'between ms':>11} {'lightning ms':>13} {'ratio':>7} "
        f"{'paired (95%)':>22} {'api cpu ms':>11} {'lightning cpu ms':>17} {'cpu paired (95%)':>22} {'faults/step':>12}"
    )
    for name, row in found.items():
        api, between, lit = (
            statistics.median(row[k]) * 1e3 if row.get(k) else math.nan
            for k in ("api", "api-between", "lightning")
        )
        api_cpu, lit_cpu = (statistics.median(row[f"{k} cpu"]) * 1e3 for k in ("api", "lightning"))
        paired, cpu = interval(row["paired"]), interval(row["paired cpu"])
        faults = [statistics.median(row[f"{k} faults"]) for k in ("api", "lightning")]
        table[name] = {
            "api_ms": api,
            "api_between_ms": between,
            "lightning_ms": lit,
            "ratio": lit / api,
            "paired": paired,
            "api_cpu_ms": api_cpu,
            "lightning_cpu_ms": lit_cpu,
            "cpu_paired": cpu,
            "faults_per_step": faults,
            "rounds": len(row["paired"]),
            "steps_per_contender": len(row["api"]),
        }
        print(
            f"{name:10} {api:8.1f} {between:11.1f} {lit:13.1f} {lit / api:7.3f} {show(paired):>22} "
            f"{api_cpu:11.1f} {lit_cpu:17.1f} {show(cpu):>22} {faults[0]:>5.0f} / {faults[1]:<5.0f}"
        )
    with open(args.out, "w") as handle:
        json.dump(table, handle, indent=1)


if __name__ == "__main__":
    main()

"""Communication-efficient training on a slow link: every option against exact DDP and the
compute-only bound, on two hosts joined by a shaped link (or on loopback).

    python benchmarks/bench_slow_link.py --rate 100mbit --steps 200     # two namespaces, root
    python benchmarks/bench_slow_link.py --loopback --steps 500 --only bound,ddp,powersgd

Each configuration is a whole `dataparallel train` run of gpt-small on the built-in corpus with
the same seed and token budget (steps x 2 ranks x --batch (16) x 128 tokens), one rank per host and one
thread per rank. "bound" is local SGD that never synchronises: the same processes and data
with no communication at all, so its throughput is the compute-only bound. The peer is PyTorch
DDP with `powerSGD_hook` (benchmarks/peer_powersgd.py). Runs go one after another (a run is
minutes long; they cannot be interleaved step by step), in the order given; the table reports
wall time of the training steps, median step time, throughput against the bound, bytes each
rank handed to collectives per step (mean over the run), and the final validation loss
against DDP's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The helpers this script shares with the tests (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import host_namespaces  # noqa: E402

# [Note: the DiLoCo recipe]: `--diloco H` alone now streams as the recipe says; the rows
# measured before it spell the paper's DiLoCo (or their streaming settings) in full.
PLAIN = "--fragments 1 --overlap 0 --outer-warmup 0".split()
STREAMING_H20 = "--diloco 20 --fragments 4 --overlap 1 --outer-compress int4".split()


# The inner recipe of "Scaling Laws for DiLoCo" (Charles et al. 2025) for a run of T steps
# (docs/compression.md, "Low communication at the papers' figures"), DDP's rows too: AdamW
# beta2 0.99, warm-up a tenth of the run, cosine to 5%, weight decay 1/T independent of the
# learning rate (torch's AdamW multiplies it by lr: 1 / (T x 2e-3)), gradient clip 1.0 (the
# job's default). A row named "...-paper..." runs on it; "...-alone-X" on one element X of it.
def paper_flags(steps: int, only: str = "") -> list[str]:
    elements = {
        "b099": ["--beta2", "0.99"],
        "warmup": ["--warmup-steps", str(steps // 10)],
        "min005": ["--min-lr-ratio", "0.05"],
        "wd": ["--weight-decay", f"{1 / (steps * 2e-3):g}"],
    }
    return elements[only] if only else [f for flags in elements.values() for f in flags]


PAPER_DILOCO = ["--diloco", "30", *PLAIN, "--outer-compress", "fp32"]
THE_PAPERS_OUTER = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]
CONFIGS = {  # name -> dataparallel train flags (a row's --nproc and --batch override)
    "bound": ["--local-sgd", "1000000"],
    "ddp": [],
    "ddp-bf16": ["--compress", "bf16"],
    "powersgd": "--compress powersgd:rank=4,start=10".split(),
    "powersgd-r16": "--compress powersgd:rank=16,start=10".split(),
    "topk": ["--compress", "topk:ratio=0.01"],
    "int8": ["--compress", "int8"],
    "local-sgd": ["--local-sgd", "50"],
    "diloco-int8": ["--diloco", "50", *PLAIN, "--outer-compress", "int8"],
    "diloco": ["--diloco", "50", *PLAIN, "--outer-compress", "fp32"],  # as torchft sends
    "local-sgd-h10": ["--local-sgd", "10"],
    "diloco-int8-h10": ["--diloco", "10", *PLAIN, "--outer-compress", "int8"],
    "diloco-h20": ["--diloco", "20", *PLAIN, "--outer-compress", "fp32"],
    # Streaming DiLoCo ([Note: streaming DiLoCo]): 4 fragments in turn, each all-reduce
    # behind one inner step, 4-bit outer gradients with error feedback.
    "streaming-h20": [*STREAMING_H20, "--outer-warmup", "0"],
    "streaming-h20-fp32": [*STREAMING_H20[:-1], "fp32", "--outer-warmup", "0"],
    "streaming-h20-w30": [*STREAMING_H20, "--outer-warmup", "30"],
    "streaming-h10-w15": "--diloco 10 --fragments 2 --overlap 1 --outer-compress int4 "
    "--outer-warmup 15".split(),
    "streaming-h10": "--diloco 10 --fragments 2 --overlap 1 --outer-compress int4 "
    "--outer-warmup 0".split(),
    "streaming": "--diloco 50 --fragments 5 --overlap 1 --outer-compress int4 "
    "--outer-warmup 0".split(),
    # The recipe's ingredients (docs/compression.md), on top of streaming-h20; since the
    # final average landed, every DiLoCo row ends on the replicas' average.
    "streaming-h20-w8": [*STREAMING_H20, "--outer-warmup", "8"],
    "streaming-h20-w15": [*STREAMING_H20, "--outer-warmup", "15"],
    "streaming-h40-w15": "--diloco 40 --fragments 4 --overlap 1 --outer-compress int4 "
    "--outer-warmup 15".split(),
    "streaming-h20-w40": [*STREAMING_H20, "--outer-warmup", "40"],
    "streaming-h20-m5": [*STREAMING_H20, "--outer-warmup", "0", "--outer-momentum", "0.5"],
    "streaming-h20-lr1": [*STREAMING_H20, "--outer-warmup", "0", "--outer-lr", "1.0"],
    "streaming-h20-mix0": [*STREAMING_H20, "--outer-warmup", "0", "--mix", "0"],
    "streaming-h20-mix75": [*STREAMING_H20, "--outer-warmup", "0", "--mix", "0.75"],
    "streaming-h20-mix9": [*STREAMING_H20, "--outer-warmup", "0", "--mix", "0.9"],
    "recipe-h20": ["--diloco", "20"],  # the default: [Note: the DiLoCo recipe]
    "recipe-h10": ["--diloco", "10"],  # the recipe at twice the outer steps (2 fragments)
    "recipe-h20-w200": ["--diloco", "20", "--outer-warmup", "200"],  # a longer streamed warm-up
    # Issue 42 (paper_flags above): the paper's DiLoCo, H = 30, on the job's inner settings,
    # on each element of the paper's inner recipe alone, and on all of it; then its outer
    # settings swept; "-chosen" rows take the table's ([Note: the outer learning rate]).
    "diloco-h30": [*PAPER_DILOCO, *THE_PAPERS_OUTER],
    "diloco-h30-alone-b099": [*PAPER_DILOCO, *THE_PAPERS_OUTER],
    "diloco-h30-alone-warmup": [*PAPER_DILOCO, *THE_PAPERS_OUTER],
    "diloco-h30-alone-min005": [*PAPER_DILOCO, *THE_PAPERS_OUTER],
    "diloco-h30-alone-wd": [*PAPER_DILOCO, *THE_PAPERS_OUTER],
    "m1-diloco-h30": [*PAPER_DILOCO, *THE_PAPERS_OUTER, "--nproc", "1", "--batch", "16"],
    "ddp-paper": [],
    "diloco-h30-paper": [*PAPER_DILOCO, *THE_PAPERS_OUTER],
    "diloco-h30-paper-lr04": [*PAPER_DILOCO, "--outer-lr", "0.4", "--outer-momentum", "0.9"],
    "diloco-h30-paper-lr10": [*PAPER_DILOCO, "--outer-lr", "1.0", "--outer-momentum", "0.9"],
    "diloco-h30-paper-inner-lr1e3": [*PAPER_DILOCO, *THE_PAPERS_OUTER, "--lr", "1e-3"],
    "diloco-h30-paper-m08": [*PAPER_DILOCO, "--outer-lr", "0.7", "--outer-momentum", "0.8"],
    "diloco-h30-paper-m06": [*PAPER_DILOCO, "--outer-lr", "0.7", "--outer-momentum", "0.6"],
    "diloco-h30-paper-m04": [*PAPER_DILOCO, "--outer-lr", "0.7", "--outer-momentum", "0.4"],
    "diloco-h30-paper-lr10-m08": [*PAPER_DILOCO, "--outer-lr", "1.0", "--outer-momentum", "0.8"],
    "diloco-h30-paper-lr10-m06": [*PAPER_DILOCO, "--outer-lr", "1.0", "--outer-momentum", "0.6"],
    "m4-diloco-h30-paper-m08": [
        *PAPER_DILOCO,
        *"--outer-lr 0.7 --outer-momentum 0.8".split(),
        *"--nproc 4 --batch 4".split(),
    ],
    "m1-diloco-h30-paper-m08": [
        *PAPER_DILOCO,
        *"--outer-lr 0.7 --outer-momentum 0.8".split(),
        *"--nproc 1 --batch 16".split(),
    ],
    # the outer settings at other H (2 replicas): the table's H = 10 and H = 100 cells
    **{
        f"diloco-h{h}-paper-{name}": [
            *PAPER_DILOCO[:1],
            str(h),
            *PAPER_DILOCO[2:],
            "--outer-lr",
            lr,
            "--outer-momentum",
            momentum,
        ]
        for h in (10, 100)
        for name, lr, momentum in (
            ("m08", "0.7", "0.8"),
            ("m09", "0.7", "0.9"),
            ("lr10-m09", "1.0", "0.9"),
            ("m06", "0.7", "0.6"),
        )
    },
    "diloco-h30-paper-chosen": PAPER_DILOCO,
    "diloco-h30-paper-chosen-int4": [*PAPER_DILOCO, "--outer-compress", "int4"],
    "recipe-h30-paper": ["--diloco", "30"],  # streamed as the recipe says, the outer chosen
    "muon-ddp-paper": ["--optimizer", "muon"],
    "muloco-h30-paper": [
        *PAPER_DILOCO,
        "--optimizer",
        "muon",  # MuLoCo's paper's outer
        *"--outer-lr 0.7 --outer-momentum 0.6".split(),
    ],
    # MuLoCo's outer settings swept on the proxy: the AdamW cell's 0.8, and a larger step at 0.6
    **{
        f"muloco-h30-paper-{name}": [
            *PAPER_DILOCO,
            *"--optimizer muon".split(),
            *f"--outer-lr {lr} --outer-momentum {momentum}".split(),
        ]
        for name, lr, momentum in (("m08", "0.7", "0.8"), ("lr10-m06", "1.0", "0.6"))
    },
    # Compression under AdamW (docs/compression.md): exact steps first, a higher rank.
    "powersgd-s30": "--compress powersgd:rank=4,start=30".split(),
    "powersgd-s60": "--compress powersgd:rank=4,start=60".split(),
    "powersgd-r16-s10": "--compress powersgd:rank=16,start=10".split(),
    "powersgd-r8-s30": "--compress powersgd:rank=8,start=30".split(),
    "powersgd-r8-s10": "--compress powersgd:rank=8,start=10".split(),
    "powersgd-r16-s0": "--compress powersgd:rank=16".split(),
    "powersgd-r32": "--compress powersgd:rank=32".split(),  # issue 42 item 5: the long run
    # Top-k under AdamW: a larger share sent, exact steps first.
    "topk-r05": ["--compress", "topk:ratio=0.05"],
    "topk-r10": ["--compress", "topk:ratio=0.1"],
    "topk-s30": ["--compress", "topk:ratio=0.01,start=30"],
    "topk-r10-s30": ["--compress", "topk:ratio=0.1,start=30"],
    "peer-powersgd": None,  # PyTorch DDP + powerSGD_hook
    "peer-torchft-diloco": None,  # torchft's DiLoCo, H = 50, fp32 outer gradients
}
# what runs without --only; every other row only when named
DEFAULT_ROWS = ("bound", "ddp", "ddp-bf16", "powersgd", "topk", "int8", "local-sgd",
                "diloco-int8", "streaming", "peer-powersgd")  # fmt: skip
MODEL = ["gpt-small"]  # --model
BATCH = ["16"]  # --batch
COMMON = ["--eval-every", "0", "--threads", "1", "--warmup-steps", "30"]


def summarize(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    return {
        "train_time_s": sum(r["step_time_s"] for r in train),
        "step_time_median_s": statistics.median(r["step_time_s"] for r in train[2:]),
        "bytes_per_step": sum(r["bytes_sent"] for r in train) / len(train),
        # what crosses the link ([Note: bytes on the wire] in comm/wire.py)
        "wire_per_step": sum(r.get("wire_bytes", r["bytes_sent"]) for r in train) / len(train),
        "val_loss": val[-1]["val_loss"],
        "tokens": sum(r["tokens"] for r in train),
    }


def run_ours(name: str, steps: int, out: Path, rate: str | None, loopback: bool) -> dict:
    args = [*COMMON, "--model", MODEL[0], "--batch", BATCH[0], "--steps", str(steps)]
    if "-paper" in name:
        args += paper_flags(steps)
    elif "-alone-" in name:
        args += paper_flags(steps, only=name.split("-alone-")[1])
    args += CONFIGS[name]
    if loopback:
        cmd = [sys.executable, "-m", "dataparallel.cli", "train", "--nproc", "2", "--out", str(out)]
        result = subprocess.run([*cmd, *args], capture_output=True, text=True)
        status, output = result.returncode, result.stdout + result.stderr
    else:
        status, _, output, _ = host_namespaces.train_on_two_hosts(args, str(out), rate)
    if status:
        raise RuntimeError(f"{name} failed:\n{output[-3000:]}")
    return summarize(out)


def run_peer(steps: int, out: Path, rate: str | None, loopback: bool) -> dict:
    script = str(Path(__file__).with_name("peer_powersgd.py"))
    peer_args = [script, "--steps", str(steps), "--out", str(out)]
    env_threads = {"OMP_NUM_THREADS": "1"}
    if loopback:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *peer_args]
        result = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), **env_threads})
        status, output = result.returncode, result.stdout + result.stderr
    else:

        def command(node_rank: int, link: str) -> list[str]:
            return ["env", "OMP_NUM_THREADS=1", sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
                    "--master-addr", host_namespaces.ADDRESSES[0], "--master-port",
                    str(host_namespaces.PORT), *peer_args]  # fmt: skip

        status, _, output, _ = host_namespaces.run_on_two_hosts(command, rate)
    if status:
        raise RuntimeError(f"peer failed:\n{output[-3000:]}")
    peer = json.loads((out / "peer.json").read_text())
    start = 10  # uncompressed steps first, each an all-reduce of every gradient
    full = 4 * 3_300_000
    compressed = peer["bytes_sent_per_step_compressed"]
    return {
        "train_time_s": peer["train_time_s"],
        "step_time_median_s": peer["step_time_median_s"],
        "bytes_per_step": (start * full + (steps - start) * compressed) / steps,
        "val_loss": peer["val_loss"],
        "tokens": steps * 2 * 16 * 128,
    }


def run_torchft(steps: int, out: Path, rate: str | None) -> dict:
    """torchft's DiLoCo on the two hosts (benchmarks/peer_torchft_diloco.py)."""
    script = str(Path(__file__).with_name("peer_torchft_diloco.py"))

    def command(node_rank: int, link: str) -> list[str]:
        here = host_namespaces.ADDRESSES[node_rank]
        meet = (
            ["--lighthouse-host"]
            if node_rank == 0
            else ["--lighthouse", host_namespaces.ADDRESSES[0]]
        )
        return [sys.executable, script, "--replica", str(node_rank), "--address", here, *meet,
                "--steps", str(steps), "--out", str(out)]  # fmt: skip

    status, other, output, _ = host_namespaces.run_on_two_hosts(command, rate)
    if status or other:
        raise RuntimeError(f"torchft peer failed:\n{output[-3000:]}")
    halves = [json.loads((out / f"peer-{r}.json").read_text()) for r in (0, 1)]
    return {
        "train_time_s": max(h["train_time_s"] for h in halves),
        "step_time_median_s": max(h["step_time_median_s"] for h in halves),
        "bytes_per_step": 4 * 3_290_624 / 50,  # one fp32 all-reduce of the parameters per H
        "val_loss": sum(h["val_loss_own_half"] for h in halves) / 2,  # equal token counts
        "tokens": steps * 2 * 16 * 128,
    }


def _env() -> dict:
    import os

    return dict(os.environ)


def table(results: dict, rate: str) -> str:
    bound = results.get("bound")
    ddp = results.get("ddp")
    lines = [
        f"| {rate} | wall time of steps | step (median) | throughput / bound | on the wire/step "
        "| handed/step | wire vs DDP | val loss | vs DDP |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, r in results.items():
        ratio = bound["step_time_median_s"] / r["step_time_median_s"] if bound else float("nan")
        versus = f"{r['val_loss'] / ddp['val_loss'] - 1:+.1%}" if ddp else "-"
        wire = r.get("wire_per_step", r["bytes_per_step"])
        fewer = (
            f"{ddp.get('wire_per_step', ddp['bytes_per_step']) / wire:.0f}x fewer"
            if ddp and wire
            else "-"
        )
        lines.append(
            f"| {name} | {r['train_time_s']:.0f} s | {r['step_time_median_s'] * 1000:.0f} ms | "
            f"{ratio:.2f}x | {wire / 1e6:.3f} MB | {r['bytes_per_step'] / 1e6:.3f} MB | {fewer} | "
            f"{r['val_loss']:.4f} | {versus} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc tbf rate; 'none' for unshaped")
    parser.add_argument("--loopback", action="store_true", help="2 ranks on 127.0.0.1 instead")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="gpt-small", help="the built-in model to train")
    parser.add_argument("--batch", type=int, default=16, help="windows per rank per step")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated configs, from {', '.join(CONFIGS)}",
    )
    parser.add_argument("--out", default=f"runs/slow-link-{int(time.time())}")
    args = parser.parse_args()
    MODEL[0], BATCH[0] = args.model, str(args.batch)
    if not args.loopback:
        reason = host_namespaces.available()
        if reason:
            print(f"bench_slow_link: {reason}; use --loopback", file=sys.stderr)
            return 2
    rate = None if args.rate == "none" else args.rate
    label = "loopback" if args.loopback else args.rate
    results = {}
    for name in args.only.split(","):
        out = Path(args.out) / name
        if name == "peer-powersgd":
            results[name] = run_peer(args.steps, out, rate, args.loopback)
        elif name == "peer-torchft-diloco":
            results[name] = run_torchft(args.steps, out, rate)
        else:
            results[name] = run_ours(name, args.steps, out, rate, args.loopback)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results, label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Activation checkpointing on one GPU: CUDA memory and step time with and without it, against
the planner, and a Hugging Face Llama under ZeRO-3 with transformers' own switch.

    PYTHONPATH=src python3 benchmarks/activation_checkpointing_gpu.py --json OUT.json
    python benchmarks/activation_checkpointing_gpu.py --device cpu --models gpt-tiny  # smoke

One rank (NCCL on CUDA), per model and strategy, without and with `dp.checkpoint_activations`:
- peak: `torch.cuda.max_memory_allocated` during the second step, minus what was allocated
  before it (parameters, gradients, optimizer state): what the step adds, activations first;
- step: the two forms interleaved step by step, median;
- predicted: `dp.plan(model, ranks=1, hardware="h100-node", micro_batch=BATCH)`, the same
  difference (its peak minus its held bytes) and step time.
Then a tiny Llama (built here, nothing downloaded) under ZeRO-3 for 3 AdamW steps with and
without transformers' checkpointing: the largest weight difference, the transformers version,
and whether its layers checkpoint `forward` (transformers 5) or `__call__` (4: whole units,
[Note: recomputed forward] in strategies/zero3/strategy.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import dataparallel as dp  # noqa: E402
from dataparallel.models import build_model  # noqa: E402

FORMS = ("off", "on")
BATCH = 16


def prepare(name: str, strategy: str, form: str, device):
    torch.manual_seed(0)
    model = build_model(name).to(device)
    if form == "on":
        dp.checkpoint_activations(model)
    dp.parallelize(model, strategy)
    optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-4)

    def step(x, y):
        optimizer.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        optimizer.step()

    return step


def batch(name: str, device, seed: int):
    block = build_model(name).config.block_size
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (BATCH, block + 1), generator=g)
    return t[:, :-1].to(device), t[:, 1:].to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_memory(name: str, strategy: str, form: str, device) -> int:
    """Bytes the second step adds at its peak above what was allocated before it."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    step = prepare(name, strategy, form, device)
    x, y = batch(name, device, 0)
    step(x, y)
    sync(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(x, y)
    sync(device)
    peak = torch.cuda.max_memory_allocated() - before
    del step
    return peak


def step_times(name: str, strategy: str, device, steps: int) -> dict:
    prepared = {form: prepare(name, strategy, form, device) for form in FORMS}
    x, y = batch(name, device, 1)
    times = {form: [] for form in FORMS}
    for i in range(steps + 3):
        for form in FORMS if i % 2 == 0 else FORMS[::-1]:
            sync(device)
            start = time.perf_counter()
            prepared[form](x, y)
            sync(device)
            if i >= 3:
                times[form].append(time.perf_counter() - start)
    return {form: statistics.median(t) for form, t in times.items()}


def predicted(name: str, strategy: str, form: str):
    row = dp.plan(name, ranks=1, hardware="h100-node", micro_batch=BATCH, strategies=[strategy],
                  shard_sizes=[1], activation_checkpointing=form == "on").rows[0]  # fmt: skip
    return row.peak_bytes - row.held_bytes, row.step_s


def hugging_face(device) -> dict:
    """A tiny Llama under ZeRO-3 with and without transformers' checkpointing."""
    import transformers
    from hf_fixtures import make_tiny_llama

    from dataparallel.models.hf import HFSource

    layers_class = getattr(transformers.modeling_layers, "GradientCheckpointingLayer", None)
    wraps = "none"
    if layers_class is not None:
        wraps = "__call__" if "__call__" in vars(layers_class) else "forward"
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_llama(Path(tmp) / "llama", layers=3, width=64)
        states = {}
        for form in FORMS:
            source = HFSource.open(path)
            model = source.build()
            if form == "on":
                dp.checkpoint_activations(model)
            dp.parallelize(model, dp.ZeRO3(materialize=source.materializer(model, device)))
            optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
            g = torch.Generator().manual_seed(0)
            for _ in range(3):
                rows = torch.randint(0, model.config.vocab_size, (4, 33), generator=g).to(device)
                logits = model(rows[:, :-1]).logits
                F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()
            states[form] = dp.full_state_dict(model)
    diff = max((states["on"][k] - v).abs().max().item() for k, v in states["off"].items())
    return {"transformers": transformers.__version__, "checkpoints": wraps, "max_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt-small,gpt-medium")
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    world = dp.init(backend="nccl" if args.device == "cuda" else "gloo")
    device = world.device
    rows, out = [], {"device": str(device), "torch": torch.__version__, "cases": []}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    print("| model | strategy | step adds off / on: predicted | measured MB | step on / off: "
          "predicted | measured |", "|---|---|--:|--:|--:|--:|", sep="\n")  # fmt: skip
    for name in args.models.split(","):
        for strategy in args.strategies.split(","):
            memory = {form: step_memory(name, strategy, form, device) for form in FORMS}
            times = step_times(name, strategy, device, args.steps)
            plan = {form: predicted(name, strategy, form) for form in FORMS}
            case = {"model": name, "strategy": strategy, "memory": memory, "times": times,
                    "predicted": plan}  # fmt: skip
            out["cases"].append(case)
            rows.append(
                f"| {name} | {strategy} | {plan['off'][0] / 1e6:.0f} / {plan['on'][0] / 1e6:.0f} "
                f"| {memory['off'] / 1e6:.0f} / {memory['on'] / 1e6:.0f} | "
                f"{plan['on'][1] / plan['off'][1]:.2f}x | {times['on'] / times['off']:.2f}x "
                f"({times['off'] * 1e3:.1f} -> {times['on'] * 1e3:.1f} ms) |"
            )
            print(rows[-1], flush=True)
    try:
        out["hugging_face"] = hugging_face(device)
    except Exception as error:  # reported, not hidden
        out["hugging_face"] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(out["hugging_face"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dp.destroy()


if __name__ == "__main__":
    main()

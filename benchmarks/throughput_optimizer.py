"""gpu_throughput.py's optimizer section (issue 40, item 4): AdamW's step alone, our flat step
([Note: flat step] in strategies/parts/flat_step.py, under `dp.DDP`) against PyTorch's own
implementations of the same update: the for-loop, `foreach=True` (its default on CUDA) and
`fused=True`, and the flat step with torch's default kernel and with `fused=True`. fp32
parameters and state; the gradients of one small backward, kept; each step
timed from a synchronised start to a synchronised end, the median of the timed steps."""

from __future__ import annotations

import statistics
import time

import torch
from contenders import EXTRA_MODELS
from throughput_contenders import LR, Context, sync
from throughput_models import build

import dataparallel as dp
from dataparallel.models import GPT

IMPLEMENTATIONS = {
    "torch-forloop": {"foreach": False},
    "torch-foreach": {"foreach": True},
    "torch-fused": {"fused": True},
    # dp.build_optimizer under dp.DDP: the flat step over each bucket, with torch's default
    # kernel, then fused ([Note: the fused flat step] in strategies/parts/flat_step.py)
    "ours-flat": None,
    "ours-flat-fused": "fused",
}


def models(ctx: Context) -> dict:
    """The size's Llama and gpt-deep-narrow (388 small tensors: per-tensor work shows)."""
    deep_narrow = EXTRA_MODELS["gpt-deep-narrow"]
    return {
        ctx.size.name: (lambda: build(ctx.size, ctx.device), ctx.size.config.vocab_size, True),
        "gpt-deep-narrow": (lambda: GPT(deep_narrow).to(ctx.device), deep_narrow.vocab_size, False),
    }


def gradients(model, vocab: int, hf: bool, device) -> None:
    """One backward of a short batch: the step's gradients (their values do not matter)."""
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    loss = model(input_ids=ids, labels=ids).loss if hf else model(ids).float().logsumexp(-1).mean()
    loss.backward()


def step_ms(ctx: Context, name: str, make, vocab: int, hf: bool) -> tuple[float, int]:
    """Median ms of AdamW's step by `name`'s implementation, and the tensors it steps."""
    torch.manual_seed(0)
    model = make()
    options = IMPLEMENTATIONS[name]
    if not isinstance(options, dict):
        model = dp.parallelize(model, dp.DDP(), group=ctx.world.group)
        fused = {"fused": True} if options == "fused" else {}
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=LR, **fused)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **options)
    gradients(model, vocab, hf, ctx.device)
    times = []
    for i in range(ctx.warmup + ctx.steps):
        sync(ctx.device)
        started = time.perf_counter()
        optimizer.step()
        sync(ctx.device)
        if i >= ctx.warmup:
            times.append(time.perf_counter() - started)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    return statistics.median(times) * 1e3, tensors


def optimizer_rows(ctx: Context, keep_going) -> list[dict]:
    """One row per model and implementation; `keep_going()` False: the rest are skipped."""
    rows = []
    for model_name, (make, vocab, hf) in models(ctx).items():
        measured = {}
        for name in IMPLEMENTATIONS:
            row = {"model": model_name, "implementation": name}
            if not keep_going():
                rows.append({**row, "ms": None, "note": "skipped: budget spent"})
                continue
            try:
                measured[name], tensors = step_ms(ctx, name, make, vocab, hf)
                rows.append({**row, "ms": measured[name], "note": f"{tensors} tensors"})
            except Exception as exc:  # a path that does not run here is a result too
                rows.append({**row, "ms": None, "note": f"{type(exc).__name__}: {exc}"[:120]})
        foreach = measured.get("torch-foreach")
        for row in rows[-len(IMPLEMENTATIONS) :]:
            if row["ms"] is not None and foreach:
                row["vs_foreach"] = row["ms"] / foreach
    return rows

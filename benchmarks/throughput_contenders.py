"""The contenders of gpu_throughput.py: one training step of a Hugging Face Llama, each the way
its users write it, timed over the same batch from the same initial weights.

A contender is `run(ctx) -> Measured`. The bound is a hand-written loop (bf16 autocast over
fp32 weights, each decoder layer compiled, fused AdamW); the peers are PyTorch's DDP and FSDP2
(`fully_shard` per layer and at the root, a bf16 `MixedPrecisionPolicy`) at world 1, compiled
per layer as torchtitan does, with AdamW's defaults, and `transformers.Trainer` (bf16, its
defaults, not compiled); ours are the API (`dp.parallelize` with DDP or ZeRO-3 and the bf16
policy, each layer compiled after wrapping, [Note: compile] in strategies/zero3/strategy.py)
and the job (`dataparallel train --model hf:DIR --init random`, a process of its own).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from throughput_models import (
    PEAK_ENV,
    PEAK_PROBE,
    Size,
    build,
    read_probed_peak,
    write_hf_dir,
    write_tokens,
)

import dataparallel as dp

LR = 3e-4
BF16 = torch.bfloat16
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Context:
    """What every contender is run with.

    size: the model and batch. device: where it runs. world: `dp.init`'s world of one.
    steps: timed steps, after `warmup` untimed ones (the compile happens in the first).
    backend: torch.compile's backend ("inductor"; the suite's CPU run: "eager").
    timeout: seconds a contender in a process of its own (the job) may take; what it logged
        by then counts.
    """

    size: Size
    device: torch.device
    world: object
    steps: int
    warmup: int
    backend: str = "inductor"
    timeout: float = 300.0


@dataclass
class Measured:
    """One contender's run: the timed steps' seconds, every step's loss, the CUDA peak
    (`torch.cuda.max_memory_allocated` from the contender's build to its last step; None on
    CPU) and a note (how it ran, what it could not)."""

    step_s: list[float]
    losses: list[float]
    peak_bytes: int | None = None
    note: str = ""
    tokens_per_s: float = field(default=0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_layers(model, backend: str) -> None:
    """Compile each decoder layer in place (`Module.compile`): one compile serves all of them."""
    torch._dynamo.config.cache_size_limit = 64
    for layer in decoder_layers(model):
        layer.compile(backend=backend)


def decoder_layers(model) -> list[torch.nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def timed(ctx: Context, step: Callable[[torch.Tensor], torch.Tensor], ids, note="") -> Measured:
    """`step(ids)` warmup + steps times; each timed from a synchronised start to its loss."""
    losses, times = [], []
    for i in range(ctx.warmup + ctx.steps):
        sync(ctx.device)
        started = time.perf_counter()
        loss = step(ids).item()  # waits for the step
        if i >= ctx.warmup:
            times.append(time.perf_counter() - started)
        losses.append(loss)
    return Measured(times, losses, peak(ctx.device), note)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def plain_step(model, optimizer, autocast: bool, device) -> Callable:
    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=BF16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


# -- the contenders ---------------------------------------------------------------------------
def bound(ctx: Context) -> Measured:
    """A hand-written loop: bf16 autocast, layers compiled, fused AdamW."""
    model = build(ctx.size, ctx.device)
    compile_layers(model, ctx.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    step = plain_step(model, optimizer, True, ctx.device)
    return timed(ctx, step, _ids(ctx), "autocast bf16, fused AdamW")


def torch_ddp(ctx: Context) -> Measured:
    from torch.nn.parallel import DistributedDataParallel

    model = build(ctx.size, ctx.device)
    compile_layers(model, ctx.backend)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    step = plain_step(wrapped, optimizer, True, ctx.device)
    return timed(ctx, step, _ids(ctx), "autocast bf16, AdamW default")


def fsdp2(ctx: Context) -> Measured:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(ctx.size, ctx.device)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    compile_layers(model, ctx.backend)  # torchtitan: compile each block, then shard it
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    step = plain_step(model, optimizer, False, ctx.device)
    return timed(ctx, step, _ids(ctx), "MixedPrecisionPolicy(bf16, reduce fp32), AdamW default")


def ours(strategy: str) -> Callable[[Context], Measured]:
    """Our API: `dp.parallelize` with `strategy`'s policy and bf16 parameters (fp32 masters),
    layers compiled after wrapping, `dp.build_optimizer` (AdamW `fused=True` as the bound's,
    the flat step running the fused kernel over each run: [Note: the fused flat step])."""

    def run(ctx: Context) -> Measured:
        policy = {"ddp": dp.DDP, "zero3": dp.ZeRO3}[strategy]
        precision = dp.MixedPrecision(param_dtype=BF16)
        # A LoRA base is built in bf16 (an 8B never exists in fp32); its adapters stay fp32
        # (peft's default), the policy gives them bf16 copies over fp32 masters.
        dtype = BF16 if ctx.size.lora else torch.float32
        model = dp.parallelize(
            build(ctx.size, ctx.device, dtype), policy(precision=precision), group=ctx.world.group
        )
        if not ctx.size.lora:  # peft's wrappers are left eager
            compile_layers(model, ctx.backend)
        optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=LR, fused=True)
        step = plain_step(model, optimizer, False, ctx.device)
        note = f"dp.{policy.__name__}, bf16 parameters, fused AdamW"
        return timed(ctx, step, _ids(ctx), note)

    run.__name__ = f"ours_{strategy}"
    return run


def hf_trainer(ctx: Context) -> Measured:
    """`transformers.Trainer` with bf16 and its defaults (AdamW as it picks it, clip 1.0),
    the batch in order every step (a sequential sampler), timed by a callback."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback

    ids = _ids(ctx).cpu()
    rows = [{"input_ids": r, "labels": r} for r in ids] * (ctx.warmup + ctx.steps)
    starts, times, losses = {}, [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync(ctx.device)
            starts["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(ctx.device)
            if state.global_step > ctx.warmup:
                times.append(time.perf_counter() - starts["t"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset or self.train_dataset)

    folder = tempfile.mkdtemp(prefix="gpu-throughput-trainer-")
    # As a one-GPU user runs it (`python train.py`, no torchrun): without the world's variables
    # the Trainer (accelerate) does not wrap the model in DDP with find_unused_parameters.
    hidden = {k: os.environ.pop(k) for k in WORLD_VARIABLES if k in os.environ}
    try:
        return _train(ctx, folder, rows, Clock(), InOrder, times, losses)
    finally:
        os.environ.update(hidden)


def _train(ctx, folder, rows, clock, trainer_class, times, losses) -> Measured:
    from transformers import TrainingArguments

    arguments = TrainingArguments(
        output_dir=folder,
        per_device_train_batch_size=ctx.size.batch,
        bf16=True,
        max_steps=ctx.warmup + ctx.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=ctx.device.type == "cpu",
        dataloader_pin_memory=False,
    )
    trainer = trainer_class(
        model=build(ctx.size, ctx.device), args=arguments, train_dataset=rows, callbacks=[clock]
    )
    trainer.train()
    shutil.rmtree(folder, ignore_errors=True)
    optim = getattr(arguments.optim, "value", arguments.optim)
    note = f"bf16, optim {optim}, wrapped {type(trainer.model_wrapped).__name__}"
    return Measured(times, losses, peak(ctx.device), note)


JOB_STRATEGY, JOB_PRECISION = "ddp", "bf16-params"


def job_command(ctx: Context, folder: Path) -> list[str]:
    """`dataparallel train` on the size's model from its config alone, the same batch size,
    sequence, learning rate and precision as the API's contender; not compiled (the job has
    no compile option); a validation pass at the start and the end only, of one window."""
    steps = ctx.warmup + ctx.steps
    model = write_hf_dir(ctx.size, folder / "model")
    data = write_tokens(ctx.size, folder / "tokens.npy", steps)
    c = ctx.size.config
    command = [
        sys.executable,
        "-m",
        "dataparallel.cli",
        "train",
        "--model",
        f"hf:{model}",
        "--init",
        "random",
        "--data",
        str(data),
        "--block-size",
        str(c.seq_len),
        "--batch",
        str(ctx.size.batch),
        "--steps",
        str(steps),
        "--lr",
        str(LR),
        "--warmup-steps",
        "0",
        "--precision",
        JOB_PRECISION,
        "--strategy",
        JOB_STRATEGY,
        "--nproc",
        "1",
        "--eval-every",
        "0",
        "--eval-windows",
        "1",
        "--log-every",
        "1",
        "--report-to",
        "none",
        "--seed",
        "0",
        "--out",
        str(folder / "run"),
    ]
    if ctx.device.type == "cpu":
        command += ["--threads", "1"]
    return command


def job(ctx: Context) -> Measured:
    """The job in a process of its own; its tokens/s from metrics.jsonl (the timed steps'),
    its CUDA peak through peak_probe/sitecustomize.py. Cut at `ctx.timeout`: what it logged
    by then still counts (its end-of-run checkpoint and export are not timed)."""
    import json

    folder = Path(tempfile.mkdtemp(prefix="gpu-throughput-job-"))
    command = job_command(ctx, folder)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PEAK_PROBE), env.get("PYTHONPATH", "")])
    env[PEAK_ENV] = str(folder / "peak")
    for name in WORLD_VARIABLES:
        env.pop(name, None)  # this process' world of one is not the job's
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=ctx.timeout)
        exit_note = f"exit {done.returncode}"
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    except subprocess.TimeoutExpired:
        exit_note, tail = f"cut at {ctx.timeout:.0f} s", [""]
    metrics = folder / "run" / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise RuntimeError(f"the job logged no step ({exit_note}): {tail[0][:160]}")
    flags = " ".join(command[command.index("train") :]).replace(str(folder), "TMP")
    timed_steps = train[ctx.warmup :] or train
    m = Measured(
        [r["step_time_s"] for r in timed_steps],
        [r["loss"] for r in train],
        read_probed_peak(str(folder / "peak")),
        f"{exit_note}; dataparallel {flags}",
    )
    m.tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed_steps)
    shutil.rmtree(folder, ignore_errors=True)  # a 1B run's checkpoint is 20 GB
    return m


def _ids(ctx: Context) -> torch.Tensor:
    from throughput_models import batch

    return batch(ctx.size, ctx.device)

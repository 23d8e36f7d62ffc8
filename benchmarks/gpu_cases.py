"""The GPU check's cases (gpu_check.py runs each in a world of its own): parity of every strategy
against plain PyTorch, on a GPT and a Hugging Face Llama, compiled and eager; memory; checkpoints
across strategies; step times against PyTorch DDP and FSDP2. Each takes the world and returns
rows {check, case, ok, value}."""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import time

import torch
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.models import GPT, MODEL_CONFIGS, GPTConfig

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PRECISIONS = {
    "fp32": None,
    "bf16-params": dp.MixedPrecision(param_dtype=torch.bfloat16),
    "fp16-params": dp.MixedPrecision(param_dtype=torch.float16),
}
TOL = {"fp32": 1e-4, "bf16-params": 2e-2, "fp16-params": 2e-2}  # relative to the movement
SMALL_GPT = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
DEEP_NARROW = GPTConfig(vocab_size=256, block_size=64, n_layer=24, n_head=4, n_embd=64)


def policy(name: str, precision=None):
    return {"ddp": dp.DDP, "zero1": dp.ZeRO1, "zero2": dp.ZeRO2, "zero3": dp.ZeRO3}[name](
        precision=precision
    )


def batch(step: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, SMALL_GPT.vocab_size, (size, SMALL_GPT.block_size + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def small_gpt() -> torch.nn.Module:
    return GPT(SMALL_GPT)


def tiny_llama() -> torch.nn.Module:
    """A Hugging Face Llama (transformers' own modules), built from a config: nothing read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=SMALL_GPT.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=SMALL_GPT.block_size,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def lm_loss(model, x, y) -> torch.Tensor:
    out = model(x)
    logits = (out.logits if hasattr(out, "logits") else out).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def reference_run(device, precision, steps: int, size: int, n: int, build=small_gpt):
    """One process, plain PyTorch: low-precision weights with fp32 masters when asked."""
    torch.manual_seed(0)
    model = build().to(device)
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    initial = [m.detach().clone() for m in masters]
    if precision is not None:
        model.to(precision.param_dtype)
    opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, size, device)
        losses = [lm_loss(model, cx, cy) for cx, cy in zip(x.chunk(n), y.chunk(n), strict=True)]
        torch.stack(losses).mean().backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    moved = max((m - m0).abs().max().item() for m, m0 in zip(masters, initial, strict=True))
    return [m.detach() for m in masters], moved


def ours_run(world, name, precision, steps: int, size: int, build=small_gpt, compile=False):
    torch.manual_seed(0)
    model = dp.parallelize(build().to(world.device), policy(name, precision))
    if compile:  # each block after wrapping ([Note: compile] in strategies/zero3/strategy.py)
        for block in model.blocks:
            block.compile()
    opt = dp.build_optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    fp16 = precision is not None and precision.param_dtype == torch.float16
    scaler = torch.amp.GradScaler(world.device.type, init_scale=2.0**10) if fp16 else None
    n, rank = world.world_size, world.rank
    for step in range(steps):
        x, y = batch(step, size, world.device)
        loss = lm_loss(model, x.chunk(n)[rank], y.chunk(n)[rank])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    state = dp.full_state_dict(model)
    return [state[k] for k, _ in build().named_parameters()]


def parity(
    world, precisions, build=small_gpt, check="parity", compile=False, strategies=STRATEGIES
):
    rows = []
    for precision_name in precisions:
        precision = PRECISIONS[precision_name]
        ref, moved = reference_run(
            world.device, precision, 4, 4 * world.world_size, world.world_size, build
        )
        for name in strategies:
            case = f"{name} {precision_name} ({world.world_size} rank, {world.backend})"
            try:
                ours = ours_run(world, name, precision, 4, 4 * world.world_size, build, compile)
                diff = max(
                    (a.float().cpu() - b.cpu()).abs().max().item()
                    for a, b in zip(ours, ref, strict=True)
                )
                ok = diff <= TOL[precision_name] * moved
                rows.append({"check": check, "case": case, "ok": ok, "value": f"{diff:.2e}"})
            except Exception as exc:  # a path that does not run here is a result too
                rows.append({"check": check, "case": case, "ok": False, "value": _why(exc)})
    return rows


def checkpoints(world) -> list[dict]:
    """Each strategy's sharded checkpoint (device tensors through DCP) loads into every other
    strategy exactly."""
    from dataparallel.checkpoint import load_state, save_chunks, state_chunks

    rows, folder = [], tempfile.mkdtemp(prefix="gpu-check-")
    for source in STRATEGIES:
        try:
            torch.manual_seed(0)
            model = dp.parallelize(GPT(SMALL_GPT).to(world.device), policy(source))
            opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
            for step in range(2):
                x, y = batch(step, 4, world.device)
                lm_loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
            save_chunks(
                state_chunks(model, opt, rank=world.rank), f"{folder}/{source}", world.group
            )
            want = dp.full_state_dict(model)
            for target in STRATEGIES:
                fresh = dp.parallelize(GPT(SMALL_GPT).to(world.device), policy(target))
                fresh_opt = dp.build_optimizer(fresh, torch.optim.AdamW, lr=1e-3)
                load_state(
                    f"{folder}/{source}", fresh, fresh_opt, rank=world.rank, group=world.group
                )
                got = dp.full_state_dict(fresh)
                diff = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
                case = f"{source} -> {target} ({world.backend})"
                rows.append(
                    {"check": "checkpoint", "case": case, "ok": diff == 0, "value": f"{diff:.1e}"}
                )
        except Exception as exc:  # a path that does not run here is a result too
            rows.append({"check": "checkpoint", "case": source, "ok": False, "value": _why(exc)})
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def memory(world) -> list[dict]:
    # The first matrix product and backward on a GPU take cuBLAS's workspaces from the caching
    # allocator (70 MB on an H100, charged to whichever strategy came first): take them first.
    warm = GPT(SMALL_GPT).to(world.device)
    lm_loss(warm, *batch(0, 4, world.device)).backward()
    del warm
    rows = []
    for name in STRATEGIES:
        # The last strategy's model and optimizer hang in reference cycles (hooks that hold
        # their module) until a collection: one that ran mid-measurement made ZeRO-3's row
        # -1.73 MB on the H100 (second run). Collect them first.
        gc.collect()
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
        before = _allocated(world.device)
        torch.manual_seed(0)
        model = dp.parallelize(GPT(SMALL_GPT).to(world.device), policy(name))
        opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
        x, y = batch(0, 4, world.device)
        lm_loss(model, x, y).backward()
        opt.step()
        report = dp.memory_report(model, opt)
        held = report["params"] + report["grads"] + report["optimizer_state"]
        allocated = _allocated(world.device) - before
        value = f"report {held / 1e6:.2f} MB, allocated {allocated / 1e6:.2f} MB"
        # On CUDA the report should account for what the allocator holds after the step (a
        # quarter either way leaves room for allocator rounding and the gathered root unit).
        ok = held > 0 and (allocated == 0 or abs(held / allocated - 1) < 0.25)
        rows.append({"check": "memory", "case": name, "ok": ok, "value": value})
        del model, opt
    return rows


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def step_times(world, config: GPTConfig, label: str, steps: int) -> list[dict]:
    """Ours and the peers on one rank, interleaved step by step; median ms per step."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    contenders = {}
    for name in ("ddp", "zero2", "zero3"):
        torch.manual_seed(0)
        model = dp.parallelize(GPT(config).to(world.device), name)
        contenders[name] = (model, dp.build_optimizer(model, torch.optim.AdamW, lr=3e-4))
    torch.manual_seed(0)
    ids = [world.device.index] if world.device.type == "cuda" else None
    peer = DistributedDataParallel(GPT(config).to(world.device), device_ids=ids)
    contenders["torch-ddp"] = (peer, torch.optim.AdamW(peer.parameters(), lr=3e-4))
    torch.manual_seed(0)
    sharded = GPT(config).to(world.device)
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    contenders["fsdp2"] = (sharded, torch.optim.AdamW(sharded.parameters(), lr=3e-4))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=g)
    x, y = x[:, :-1].to(world.device), x[:, 1:].to(world.device)
    times = {name: [] for name in contenders}
    for step in range(steps + 3):
        for name, (model, opt) in contenders.items():
            _sync(world.device)
            started = time.perf_counter()
            opt.zero_grad()
            lm_loss(model, x, y).backward()
            opt.step()
            _sync(world.device)
            if step >= 3:  # warm-up
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    rows = []
    for name, ms in medians.items():
        versus = {"ddp": "torch-ddp", "zero2": "fsdp2", "zero3": "fsdp2"}.get(name)
        ratio = f", {ms / medians[versus]:.2f}x {versus}" if versus else ""
        rows.append(
            {"check": f"step {label}", "case": name, "ok": True, "value": f"{ms:.2f} ms{ratio}"}
        )
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


def fp32_parity(world):
    return parity(world, ["fp32"])


def all_parity(world):
    return parity(world, list(PRECISIONS))


def hf_parity(world):
    return parity(world, ["fp32", "bf16-params"], tiny_llama, "hf llama")


def compiled_parity(world):
    """torch.compile'd blocks (inductor: Triton kernels on CUDA) under each strategy, against the
    eager one-process reference."""
    return parity(world, ["fp32"], small_gpt, "compiled", compile=True)


def benchmarks(world):
    return step_times(world, MODEL_CONFIGS["gpt-small"], "gpt-small", 20) + step_times(
        world, DEEP_NARROW, "deep-narrow", 20
    )

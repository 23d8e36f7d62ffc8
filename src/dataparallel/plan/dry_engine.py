"""One role of a dry run through the real engine ([Note: dry run of a plan] in dry_run.py): the
model on the meta device, `dp.init_fake` for that rank, `dp.parallelize`, `dp.build_optimizer`
and two steps, and what the engine's own structures and the comm layer's tracer say of it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .live_bytes import LiveBytes
from .model import _FlashAttention
from .peak_terms import label_grads, label_held

DRY_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
DRY_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
HELD = ("params", "grads", "optimizer_state", "master_params")
GATHERED = "largest_gathered_unit"  # ZeRO-3: the largest buffer a gather allocated (in flight)
# the engine's agreements (used parameters, ZeRO-3's unit order): small, and not planned
CONTROL = ("used flags", "unit order", "gradient norm", "bucket order")


@dataclass(frozen=True)
class Role:
    """A rank the dry run runs: `rank` in the world, `shard_rank` in its shard group, and why
    it differs from the others (`why`: "first", "last", "padded", "holds none of a parameter")."""

    rank: int
    shard_rank: int
    why: tuple[str, ...]


@dataclass
class RoleRun:
    """What the engine did as one role.

    held / planned: bytes per category (HELD), the engine's and the footprint's.
    collectives / planned_collectives: (kind, group size) -> (bytes, calls) of one step; an
        all-gather's bytes are the gathered buffer's, as the plan counts them.
    seconds: Python time per phase (parallelize, build_optimizer, first step, step).
    control: the engine's own agreements of the step (CONTROL), which the plan leaves out.
    peak: the most bytes of meta storages alive at once during the step ([Note: meta peak]);
        with the step's time the measuring costs. 0 (and no terms) where the run did not
        measure it (`peak=False`: the mode is not entered, each operator costs what it costs).
    peak_terms: what was alive at that peak, by term ([Note: peak terms]); sums to `peak`.
    """

    role: Role
    held: dict[str, int]
    planned: dict[str, int]
    collectives: dict[tuple[str, int], tuple[int, int]]
    planned_collectives: dict[tuple[str, int], tuple[int, int]]
    seconds: dict[str, float]
    control: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    peak: int = 0
    peak_terms: dict[str, int] = field(default_factory=dict)

    def differences(self) -> list[str]:
        out = [
            f"rank {self.role.rank}: {k} held {self.held[k]} B by the engine, "
            f"{self.planned[k]} B planned"
            for k in self.held
            if self.held[k] != self.planned.get(k)
        ]
        for key in sorted(set(self.collectives) | set(self.planned_collectives)):
            got = self.collectives.get(key, (0, 0))[0]
            want = self.planned_collectives.get(key, (0, 0))[0]
            if got != want:
                out.append(
                    f"rank {self.role.rank}: {key[0]} over {key[1]} ranks sends {got} B a "
                    f"step in the engine, {want} B planned"
                )
        return out


def build_meta(model: str, tp: int, lora=None, base_dtype=torch.float32):
    """The built-in model on the meta device, fp32, narrowed to a rank's part under `tp`;
    with `lora`, its base frozen in `base_dtype` and fp32 adapters ([Note: planner LoRA])."""
    from ..models import MODEL_CONFIGS, build_model
    from .llama import LLAMA_CONFIGS, Llama
    from .lora import adapt
    from .tensor_parallel import narrow

    with torch.device("meta"):
        if model in LLAMA_CONFIGS:
            c = LLAMA_CONFIGS[model]
            net, vocab = narrow(Llama(c), tp, c.n_heads, c.n_kv_heads), c.vocab_size
        else:
            c = MODEL_CONFIGS[model]
            net, vocab = narrow(build_model(model), tp, c.n_head), c.vocab_size
        if lora is not None:
            adapt(net.to(base_dtype), lora, model)
            for p in net.parameters():
                if p.requires_grad:
                    p.data = p.data.float()  # peft keeps the adapters in fp32
    return net, vocab


def data_group(rank: int, ranks: int, tp: int):
    """The data-parallel group of `rank` (ranks `tp` apart), or None without tensor
    parallelism (every rank)."""
    if tp == 1:
        return None
    members = list(range(rank % tp, ranks, tp))
    return dist.new_group(members, use_local_synchronization=True)


def run_role(
    model,
    role: Role,
    *,
    ranks,
    tp,
    shard_size,
    policy,
    optimizer,
    micro_batch,
    seq_len,
    peak=True,
    lora=None,
    base_dtype=torch.float32,
) -> RoleRun:
    """One role's dry run on the fake process group ([Note: dry run of a plan])."""
    from ..api import build_optimizer, memory_report, parallelize
    from ..comm import Tracer
    from ..runtime import destroy, init_fake
    from ..strategies import init_mesh, tensor_bytes

    seconds: dict[str, float] = {}
    init_fake(ranks, role.rank)
    live = LiveBytes()  # [Note: meta peak] in live_bytes.py
    try:
        net, vocab = build_meta(model, tp, lora, base_dtype)
        for p in net.parameters():
            live.note(p)
        with live if peak else contextlib.nullcontext():  # not measured: no mode to pay for
            group = data_group(role.rank, ranks, tp)
            data = ranks // tp
            mesh = init_mesh(shard_size, group) if 1 < shard_size < data else None
            tracer = Tracer(enabled=False)
            start = time.perf_counter()
            live.tag = "engine buffers"
            net = parallelize(net, policy, group=None if mesh else group, mesh=mesh, tracer=tracer)
            seconds["parallelize"] = time.perf_counter() - start
            start = time.perf_counter()
            kwargs = {"momentum": 0.9} if optimizer == "sgd" else {}
            opt = build_optimizer(
                net, getattr(torch.optim, DRY_OPTIMIZERS[optimizer]), lr=1e-3, **kwargs
            )
            seconds["build_optimizer"] = time.perf_counter() - start
            tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
            for phase in ("first step", "step"):  # the plan is the steady state: the second
                tracer.enabled = phase == "step"
                if phase == "step":
                    label_held(live, net, opt)
                live.measuring = peak and phase == "step"
                start = time.perf_counter()
                live.tag = "forward"
                with _FlashAttention():  # as a GPU runs it: no s x s scores ([Note: activations])
                    logits = net(tokens)
                live.tag = "loss"
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
                live.tag = "backward"
                loss.backward()
                label_grads(live, opt)
                live.tag = "optimizer step"
                opt.step()
                opt.zero_grad()
                seconds[phase] = time.perf_counter() - start
                del logits, loss
            tracer.enabled = live.measuring = False
        report = memory_report(net, opt)
        steps = tensor_bytes(s["step"] for s in opt.state.values() if "step" in s)
        held = {k: int(report.get(k, 0)) for k in HELD + (GATHERED,) if k in HELD or k in report}
        held["optimizer_state"] -= steps
        collectives, control = traced_collectives(tracer)
        del net, opt
        return RoleRun(
            role, held, {}, collectives, {}, seconds, control, live.peak, live.peak_terms()
        )
    finally:
        destroy()


def traced_collectives(tracer) -> dict[tuple[str, int], tuple[int, int]]:
    """(kind, group size) -> (bytes, calls) of the collectives the tracer saw, an all-gather
    as its gathered buffer (the plan's X); and, apart, the engine's agreements (CONTROL)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    control: dict[tuple[str, int], tuple[int, int]] = {}
    for span in tracer.spans:
        if span.track != "comm":
            continue
        if span.args.get("what") in CONTROL:
            key = ("control: " + span.args["what"], span.args["ranks"])
            b, n = control.get(key, (0, 0))
            control[key] = (b + span.args["bytes"], n + 1)
            continue
        size, group = span.args["bytes"], span.args["ranks"]
        if span.name == "all_gather":
            size *= group
        b, n = out.get((span.name, group), (0, 0))
        out[(span.name, group)] = (b + size, n + 1)
    return out, control

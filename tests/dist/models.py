"""Small models and deterministic data for the multi-rank tests (shared by every strategy)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import checkpoint as torch_checkpoint

import dataparallel as dp
from dataparallel.models import GPT, GPTConfig


class Branchy(nn.Module):
    """A trunk, a branch taken only when asked, a frozen layer, and a head."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x, use_branch: bool = True):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h + self.frozen(h))


class MoE(nn.Module):
    """A mixture of experts: each row goes to the expert its first feature's sign picks, and an
    expert no row picked is not run (so ranks whose rows pick different experts run different
    modules)."""

    def __init__(self, experts: int = 2):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))

    def forward(self, x):
        route = (x[:, 0] > 0).long()
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = route == i
            if rows.any():
                out[rows] = expert(x[rows])
        return out


class WithMoE(nn.Module):
    """A mixture-of-experts layer on the input, a trunk, a head."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.moe = MoE()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.trunk(self.moe(x) + x))


class Odd(nn.Module):
    """Parameter sizes that divide by neither 2 nor 3 (7, 5, 11, 13 ...)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 11)
        self.c = nn.Linear(11, 5, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


# The transformers have no biases: the attention's key bias has an exactly zero true gradient,
# so its computed gradient is pure rounding noise, which Adam normalises into lr-sized steps.
# Two summation orders then disagree there by ~1e-4 even in one process with no communication,
# which would hide real differences behind noise. Every other parameter agrees to ~1e-8.
# name -> (constructor, input kind)
MODELS = {
    "mlp": (
        lambda: nn.Sequential(
            nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
        ),
        "vec8",
    ),
    "transformer": (
        lambda: GPT(
            GPTConfig(
                vocab_size=32,
                block_size=16,
                n_layer=2,
                n_head=2,
                n_embd=32,
                tie_weights=False,
                bias=False,
            )
        ),
        "tokens",
    ),
    "tied": (
        lambda: GPT(
            GPTConfig(
                vocab_size=32,
                block_size=16,
                n_layer=1,
                n_head=2,
                n_embd=32,
                tie_weights=True,
                bias=False,
            )
        ),
        "tokens",
    ),
    "branchy": (Branchy, "vec8"),
    "odd": (Odd, "vec7"),
}


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def batch(name: str, step: int, size: int):
    """The global batch of `size` samples for `step` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    kind = MODELS[name][1]
    if kind == "tokens":
        x = torch.randint(0, 32, (size, 9), generator=g)
        return x[:, :-1], x[:, 1:]
    width = 7 if kind == "vec7" else 8
    out = 5 if kind == "vec7" else 4
    return torch.randn(size, width, generator=g), torch.randn(size, out, generator=g)


def uses_branch(step: int, rank: int) -> bool:
    """Some steps no rank takes the branch; in others only some ranks do."""
    return step % 4 != 0 and (step + rank) % 3 != 0


def loss_fn(name: str, model: nn.Module, x, y, step: int, rank: int) -> torch.Tensor:
    if name == "branchy":
        return F.mse_loss(model(x, uses_branch(step, rank)), y)
    out = model(x)
    if MODELS[name][1] == "tokens":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def reference_loss(name, model, x, y, step, world_size) -> torch.Tensor:
    """Single-process loss on the global batch: the mean of the ranks' chunk losses."""
    chunks = zip(x.chunk(world_size), y.chunk(world_size), strict=True)
    losses = [loss_fn(name, model, cx, cy, step, r) for r, (cx, cy) in enumerate(chunks)]
    return torch.stack(losses).mean()


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The norm our parity tests use: max |a - b| over every element of every parameter."""
    return max(
        (pa.detach() - pb.detach()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


def train_chunks(model: nn.Module, name: str, world, steps: int, per_rank: int) -> dict:
    """A parallelized token model trained with AdamW (lr 1e-3) on this rank's chunk of each
    step's batch, the output cast to fp32 for the loss (it may compute in bf16); the
    whole-model state dict after `steps` steps."""
    opt = dp.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    for step in range(steps):
        x, y = batch(name, step, per_rank * world.world_size)
        chunk = slice(per_rank * world.rank, per_rank * (world.rank + 1))
        out = model(x[chunk]).float()
        F.cross_entropy(out.flatten(0, 1), y[chunk].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return dp.full_state_dict(model)


def accumulate(model: nn.Module, loss_of, accum: int) -> None:
    """Backward over `accum` micro-batches, each loss `loss_of(micro) / accum`, the last one
    synchronised (the others under `dp.no_sync`), as a user accumulates."""
    for micro in range(accum):
        loss = loss_of(micro) / accum
        if micro < accum - 1:
            with dp.no_sync(model):
                loss.backward()
        else:
            loss.backward()


def max_state_diff(a: dict, b: dict) -> float:
    """max |a - b| over every element of two state dicts with the same keys."""
    return max((a[k] - v).abs().max().item() for k, v in b.items())


def user_checkpointed(model, reentrant: bool = False):
    """The model's forward as a user writes it with `checkpoint(block, x)`: each block's
    `__call__`, its module hooks included, recomputed in backward."""

    def forward(idx):
        x = model.drop(model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1])))
        for block in model.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        return model.head(model.ln_f(x))

    model.forward = forward
    return model


SMALL = {"bucket_mb": 0.02, "first_bucket_mb": 0.002}  # small buckets: shards straddle params


def strategy(name: str):
    """(policy, parallelize keywords) by name, with SMALL buckets; "*-2d" on a mesh of shard
    groups of 2 (`dp.init_mesh(2)`, collective)."""
    base = name.removesuffix("-2d")
    policy = {
        "ddp": dp.DDP(**SMALL),
        "zero1": dp.ZeRO1(**SMALL),
        "zero2": dp.ZeRO2(**SMALL),
        "zero3": dp.ZeRO3(),
    }[base]
    return policy, ({"mesh": dp.init_mesh(2)} if name.endswith("-2d") else {})

"""The job's optimizer, as [optim] optimizer names it: its class, param groups and arguments.

    choice = choose_optimizer(config.optim, model, peak_lr)
    dp.compose(model, recipe, choice.cls, params=choice.groups, **choice.kwargs)

[Note: the job's optimizers]
- "adamw" (the default): AdamW over two groups, matrices and embeddings decayed, biases and
  norm weights (1-D) not, betas (beta1, beta2).
- "adafactor": torch.optim.Adafactor over the same two groups (its own decay schedule of the
  second moments; beta1/beta2 are AdamW's and unused). Whole parameters per owner under ZeRO
  ([Note: optimizer layout] in strategies/parts/optimizer_layout.py), so its moments stay factored.
- "muon": torch.optim.Muon on the hidden matrices, the trainable 2-D parameters other than the
  embeddings and the output head; AdamW (betas, decay as above) on the embeddings, the head,
  the norms and the biases. Muon gets adjust_lr_fn="match_rms_adamw", which scales its update
  to AdamW's RMS, so one --lr and one schedule (set on every group, train/step.py set_lr) serve
  both; Muon's momentum stays torch's 0.95. One GroupedOptimizer ([Note: grouped optimizer]).
  The embeddings are every nn.Embedding's weight and the model's get_input_embeddings(); the
  head is get_output_embeddings() (Hugging Face models) or a Linear named `head`/`lm_head`
  (the built-in GPT), else the last Linear whose outputs are an embedding's vocabulary (the
  built-in mlp's last layer). Parameters are compared by identity, so a head tied to the token
  embedding (the GPT's default, tied hf: models) is one parameter, on AdamW.
  Under --lora the same rule runs over the trainable parameters, the adapters: their A and B
  matrices are 2-D and neither embedding nor head, so they go to Muon (an adapted embedding's
  or head's adapters stay on AdamW); biases trained alongside go to AdamW.

[Note: the job's AdamW kernel] AdamW (alone, or in Muon's groups) is built `fused=True` on the
devices of `FUSED_DEVICES`, where torch's fused kernel is the measured fastest: over the flat
runs ([Note: the fused flat step] in strategies/parts/flat_step.py) gpt-deep-narrow's AdamW
step under DDP takes 1.5 ms, against 8.7 ms with torch's default kernel and 3.1 ms for torch's
own fused one over its 388 tensors (benchmarks/gpu_throughput.py's optimizer rows on CPU,
BENCHMARKS.md). Elsewhere (CUDA, until the GPU measurement of issue 40 decides it) torch's own
default stays. A script calling `dp.compose` or `dp.build_optimizer` gets the kernel it asks
for; the fused kernel differs from the for-loop in the last bit of some elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon", "adafactor")
FUSED_DEVICES = ("cpu",)  # [Note: the job's AdamW kernel]


@dataclass(frozen=True)
class OptimizerChoice:
    """What dp.compose takes for the job's optimizer.

    cls: the main class (a group naming its own under "optimizer" overrides it).
    groups: the param groups.
    kwargs: the main class's arguments.
    """

    cls: type[torch.optim.Optimizer]
    groups: list[dict]
    kwargs: dict = field(default_factory=dict)


def decay_groups(params: list[nn.Parameter], weight_decay: float, **extra) -> list[dict]:
    """Decay matrices and embeddings; leave biases and norm weights (1-D) undecayed."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, **extra},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, **extra},
    ]
    return [group for group in groups if group["params"]]


def embeddings_and_head(model: nn.Module) -> set[int]:
    """The ids of the embedding and output-head parameters ([Note: the job's optimizers])."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    found: list[nn.Module | None] = [*embeddings, _called(model, "get_input_embeddings")]
    heads = [_called(model, "get_output_embeddings")]
    heads += [m for m in (getattr(model, n, None) for n in ("head", "lm_head")) if _linear(m)]
    if not any(heads):  # the last Linear onto an embedding's vocabulary (the built-in mlp's)
        vocabularies = {m.num_embeddings for m in embeddings}
        onto = [m for m in model.modules() if _linear(m) and m.out_features in vocabularies]
        heads = onto[-1:]
    found += heads
    return {id(p) for module in found if module is not None for p in module.parameters()}


def _called(model: nn.Module, getter: str) -> nn.Module | None:
    """model.getter() where a Hugging Face model has it, else None."""
    if not callable(getattr(model, getter, None)):
        return None
    try:
        return getattr(model, getter)()
    except (NotImplementedError, AttributeError):
        return None


def _linear(module) -> bool:
    return isinstance(module, nn.Linear)


def muon_names(model: nn.Module) -> list[str]:
    """The trainable parameters Muon steps under "muon": 2-D, neither embedding nor head."""
    excluded = embeddings_and_head(model)
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and id(p) not in excluded
    ]


def choose_optimizer(optim, model: nn.Module, lr: float) -> OptimizerChoice:
    """[optim]'s optimizer over `model`'s trainable parameters at peak learning rate `lr`."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (optim.beta1, optim.beta2)
    kernel = adamw_kernel(params)
    if optim.optimizer == "adamw":
        kwargs = {"lr": lr, "betas": betas, **kernel}
        return OptimizerChoice(torch.optim.AdamW, decay_groups(params, optim.weight_decay), kwargs)
    if optim.optimizer == "adafactor":
        return OptimizerChoice(
            torch.optim.Adafactor, decay_groups(params, optim.weight_decay), {"lr": lr}
        )
    if optim.optimizer != "muon":
        raise ValueError(f"optim.optimizer: {optim.optimizer!r} is not one of {OPTIMIZERS}")
    named = dict(model.named_parameters())
    hidden = {id(named[name]) for name in muon_names(model)}
    rest = [p for p in params if id(p) not in hidden]
    if not hidden:
        raise ValueError(
            "--optimizer (optim.optimizer): muon finds no hidden matrix (a trainable 2-D "
            "parameter other than the embeddings and the head) in this model; use adamw"
        )
    groups = [{"params": [p for p in params if id(p) in hidden]}]
    adamw = {"optimizer": torch.optim.AdamW, "lr": lr, "betas": betas, **kernel}
    groups += decay_groups(rest, optim.weight_decay, **adamw)
    kwargs = {"lr": lr, "weight_decay": optim.weight_decay, "adjust_lr_fn": "match_rms_adamw"}
    return OptimizerChoice(torch.optim.Muon, groups, kwargs)


def adamw_kernel(params: list[nn.Parameter]) -> dict:
    """AdamW's kernel option for parameters on their device ([Note: the job's AdamW kernel])."""
    device = params[0].device.type if params else "cpu"
    return {"fused": True} if device in FUSED_DEVICES else {}

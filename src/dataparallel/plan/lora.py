"""LoRA in the planner: a built-in model with its base frozen and low-rank adapters on the
named layers, as `dataparallel train --lora` trains an `hf:` model ([Note: planner LoRA]).

[Note: planner LoRA] `--lora r=16,targets=q_proj,v_proj` (the job's spec, models/lora.py)
freezes every parameter of the meta model and puts beside each targeted nn.Linear the two
adapters peft puts there: A (r x in) and B (out x r), the update (alpha / r) B A x, dropout
none. Targets are matched on a layer's last name, as peft matches them; the planner's Llama
(llama.py) answers to Hugging Face's names as well (q_proj is wq, gate_proj w1, ...). Then:
- the trainable parameters (gradients, optimizer state, masters, buckets, units' gradients)
  are the adapters alone;
- the frozen base is held in the compute dtype (a base is loaded in it: an 8B in bf16 is
  16 GB, never 32): whole on every rank under DDP and ZeRO-1/2, in shards under ZeRO-3, its
  units gathered with their module's ([Note: frozen parameters] in strategies/zero3/plan.py)
  and all-gathered in forward and again in backward, as the trained units are;
- activations are traced with the base frozen, so a frozen layer keeps what its input
  gradient needs and no more;
- FLOPs per token: 6 per weight of a trained linear layer, 4 per weight of a frozen one
  (forward and the input's gradient, no weight gradient).
"""

from __future__ import annotations

from torch import nn

from ..models.lora import LoraSpec
from .errors import PlanError

# Hugging Face's Llama layer names -> the planner's Llama (llama.py)
LLAMA_NAMES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
    "lm_head": "output",
}


class Adapted(nn.Module):
    """A frozen linear layer and its adapters: base(x) + scale x B(A(x))."""

    def __init__(self, base: nn.Linear, r: int, scale: float):
        super().__init__()
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **like)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **like)
        self.scale = scale

    def forward(self, x):
        out = self.base(x)  # the adapters in their own dtype, as peft runs them
        update = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scale
        return out + update.to(out.dtype)


def parse_lora(
    text: str, built_in: bool = True, tp: int = 1, layout: str = "dataparallel"
) -> LoraSpec | None:
    """`--lora`'s spec for a plan of a built-in model (`built_in`) over `tp` ranks in `layout`;
    None for ""; a `PlanError` naming the flag for what is not planned."""
    if not text:
        return None
    try:
        spec = LoraSpec.parse(text)
    except ValueError as error:
        raise PlanError("--lora", str(error), "write e.g. r=16,targets=q_proj,v_proj") from None
    refusals = (
        (
            spec.dropout,
            f"dropout={spec.dropout} is not planned (its masks are not traced)",
            "drop dropout=",
        ),
        (
            not built_in,
            "adapters are put on a built-in model only",
            "give --model NAME, or an nn.Module with its adapters applied",
        ),
        (tp > 1, "LoRA under tensor parallelism is not planned", "drop --tp"),
        (
            layout == "zero-paper",
            "the ZeRO paper's layout has no frozen parameters",
            "drop --layout zero-paper",
        ),
    )
    for refused, problem, fix in refusals:
        if refused:
            raise PlanError("--lora", problem, fix)
    return spec


def check_root_unit(shape, strategies) -> None:
    """A target in ZeRO-3's root unit (the head, a tied embedding) leaves the root mixed: the
    root is never split ([Note: frozen parameters] in strategies/zero3/plan.py), so it keeps a
    gradient store for its frozen part too, and refuses mixed dtypes. Not planned: refused in
    one line where a candidate runs ZeRO-3 (zero3, DiLoCo's inner steps)."""
    mixed = shape.frozen_units and shape.frozen_units[0] and shape.units and shape.units[0]
    if mixed and any(s in ("zero3", "diloco") for s in strategies):
        raise PlanError(
            "--lora",
            "a target lies in ZeRO-3's root unit (the head or an embedding), which stays one "
            "unit with the frozen base around it",
            "drop that target, or plan --strategy ddp, zero1 or zero2",
        )


def adapt(model: nn.Module, spec: LoraSpec, name: str) -> nn.Module:
    """Freeze `model` and put adapters beside every linear layer `spec` targets; a
    `PlanError` when a target names none."""
    layers = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    for p in model.parameters():
        p.requires_grad_(False)
    found = dict.fromkeys((LLAMA_NAMES.get(t, t) for t in spec.targets), 0)  # aliases once
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in found:
                setattr(module, child_name, Adapted(child, spec.r, spec.scale))
                found[child_name] += 1
    missing = [t for t in spec.targets if found[LLAMA_NAMES.get(t, t)] == 0]
    if missing:
        raise PlanError(
            "--lora",
            f"targets {', '.join(missing)} name no linear layer of {name}",
            f"name its layers: {', '.join(layers)}{_aliases(layers)}",
        )
    return model


def _aliases(layers: list[str]) -> str:
    names = [hf for hf, ours in LLAMA_NAMES.items() if ours in layers]
    return f" (or Hugging Face's {', '.join(names)})" if names else ""

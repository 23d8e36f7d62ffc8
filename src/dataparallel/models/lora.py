"""LoRA through peft: the spec the CLI parses, the adapters applied, and the merged weights.

    spec = LoraSpec.parse("r=8,alpha=16,targets=q_proj,v_proj")
    model = apply_lora(model, spec)              # peft's LoraConfig; the base is frozen
    merged = merged_state_dict(full, spec)       # base names, W + (alpha / r) B A

[Note: LoRA names] peft wraps the model (`base_model.model.` before every name) and each
target layer (`q_proj.base_layer.weight` is the frozen weight, `q_proj.lora_A.default.weight`
and `q_proj.lora_B.default.weight` the adapter). `checkpoint_name` maps a wrapped name back to
the base model's, so the base weights load from the original directory, and the export writes
merged weights under the names the base model's `from_pretrained` expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


@dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the named layers (`--lora r=8,alpha=16,targets=q_proj,v_proj`).

    r: the adapters' rank.
    alpha: the scale numerator: the update is (alpha / r) B A.
    targets: names of the layers to adapt (the last part of a module's name, as peft matches
        them: "q_proj" adapts every attention's query projection).
    dropout: dropout on the adapters' input (0: none, what parity needs).
    """

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """`r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.05]`; a name without `=` continues
        the targets. Raises ValueError (one line) on anything else."""
        values: dict = {}
        key = None
        for part in [p.strip() for p in text.split(",") if p.strip()]:
            if "=" in part:
                key, _, value = part.partition("=")
                key = key.strip()
                if key not in {"r", "alpha", "targets", "dropout"}:
                    raise ValueError(f"unknown key {key!r}; use r, alpha, targets and dropout")
                values[key] = [value.strip()] if key == "targets" else value.strip()
            elif key == "targets":
                values["targets"].append(part)
            else:
                raise ValueError(
                    f"{part!r} has no key; write e.g. r=8,alpha=16,targets=q_proj,v_proj"
                )
        try:
            spec = cls(
                r=int(values.get("r", cls.r)),
                alpha=float(values.get("alpha", cls.alpha)),
                targets=tuple(values.get("targets", cls.targets)),
                dropout=float(values.get("dropout", cls.dropout)),
            )
        except ValueError:
            raise ValueError("r must be an integer and alpha, dropout numbers") from None
        if spec.r < 1 or spec.alpha <= 0 or not 0 <= spec.dropout < 1 or not all(spec.targets):
            raise ValueError("r >= 1, alpha > 0, dropout in [0, 1) and targets non-empty")
        return spec

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_targets_found(model: nn.Module, spec: LoraSpec) -> dict[str, int]:
    """How many linear layers each target names (a target naming none is a user error)."""
    found = dict.fromkeys(spec.targets, 0)
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in found and _adaptable(module):
            found[last] += 1
    return found


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """peft's LoRA on `spec.targets`; every other parameter frozen. Raises ValueError naming
    the targets that match no linear layer."""
    from peft import LoraConfig, get_peft_model

    missing = [t for t, n in lora_targets_found(model, spec).items() if n == 0]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"targets {', '.join(missing)} match no linear layer of the model; choose among "
            f"{', '.join(linear)}"
        )
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=spec.dropout,
        bias="none",
    )
    return get_peft_model(model, config)


def _adaptable(module: nn.Module) -> bool:
    """A layer peft's LoRA adapts: nn.Linear, or transformers' Conv1D (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def checkpoint_name(name: str) -> str:
    """The base model's name for a (possibly peft-wrapped) parameter ([Note: LoRA names])."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_state_dict(full: dict[str, torch.Tensor], spec: LoraSpec | None) -> dict:
    """The base model's state dict with each adapter folded in: W + scale x B @ A."""
    if spec is None:
        return dict(full)
    merged = {}
    for name, tensor in full.items():
        if is_lora_param(name):
            continue
        layer = adapted_layer(name)
        if layer is not None:
            a, b = (full[f"{layer}.lora_{x}.{ADAPTER}.weight"] for x in "AB")
            tensor = merge_weight(tensor, a, b, spec.scale)
        merged[checkpoint_name(name)] = tensor
    return merged


def adapted_layer(name: str) -> str | None:
    """The layer whose frozen weight `name` is, when LoRA adapts it ([Note: LoRA names])."""
    suffix = ".base_layer.weight"
    return name[: -len(suffix)] if name.endswith(suffix) else None


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float):
    """W + scale x B @ A, in W's dtype (GPT-2's Conv1D stores W transposed)."""
    update = scale * (b.float() @ a.float())
    if update.shape != weight.shape:
        update = update.T
    return (weight.float() + update).to(weight.dtype)


def adapter_state_dict(full: dict[str, torch.Tensor]) -> dict:
    """The adapters alone, under the names peft's `save_pretrained` writes."""
    return {
        name.replace(f".{ADAPTER}.", "."): tensor
        for name, tensor in full.items()
        if is_lora_param(name)
    }

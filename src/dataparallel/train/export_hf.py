"""The export of an `hf:DIR` run: RUN/hf, a `save_pretrained` directory the ecosystem loads.

    RUN/hf/model.safetensors     the trained weights under the base model's names (LoRA merged)
    RUN/hf/config.json ...       DIR's config (and generation config), unchanged
    RUN/hf/tokenizer.json ...    DIR's tokenizer
    RUN/hf/adapter/              with --lora: the adapters alone, as peft's save_pretrained writes

`AutoModelForCausalLM.from_pretrained(RUN/hf)` loads it; `PeftModel.from_pretrained(base,
RUN/hf/adapter)` puts the adapters on the original base. Written by rank 0 from the final
checkpoint one tensor at a time (a merged weight reads its base and its two adapters), into a
folder beside RUN/hf that is renamed into place when complete: an interrupted export leaves no
half directory.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import write_safetensors
from ..models.hf import HFSource
from ..models.lora import ADAPTER, adapted_layer, checkpoint_name, is_lora_param, merge_weight

HF_EXPORT = "hf"


def export_hf(entries, read, out: Path, source: HFSource, model: nn.Module) -> None:
    """Write `out` from a checkpoint's `entries` (name, shape, dtype) and `read(name)`."""
    from ..data.tokenizer import HFTokenizer

    peft_config = getattr(model, "peft_config", {}).get(ADAPTER)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    scale = peft_config.lora_alpha / peft_config.r if peft_config is not None else 0.0
    shapes = {name: shape for name, shape, _ in entries}

    def shaped(name: str) -> torch.Tensor:
        return read(name).reshape(shapes[name])

    def merged(name: str) -> torch.Tensor:
        layer = adapted_layer(name) if peft_config is not None else None
        if layer is None:
            return shaped(name)
        a, b = (shaped(f"{layer}.lora_{x}.{ADAPTER}.weight") for x in "AB")
        return merge_weight(shaped(name), a, b, scale)

    base = [(n, s, d) for n, s, d in entries if not is_lora_param(n)]
    by_base = {checkpoint_name(n): n for n, _, _ in base}
    write_safetensors(
        tmp / "model.safetensors",
        [(checkpoint_name(n), s, d) for n, s, d in base],
        lambda name: merged(by_base[name]),
        {},
    )
    config = copy.deepcopy(source.config)
    config.use_cache = True  # training turned it off; generation wants it
    config.save_pretrained(tmp)
    generation = source.path / "generation_config.json"
    if generation.is_file():
        shutil.copy(generation, tmp / generation.name)
    HFTokenizer.load(source.path).hf.save_pretrained(tmp)
    if peft_config is not None:
        _write_adapter(tmp / "adapter", entries, read, peft_config)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _write_adapter(folder: Path, entries, read, peft_config) -> None:
    """The adapters as peft writes them: adapter_model.safetensors and adapter_config.json."""
    folder.mkdir()
    lora = [(n, s, d) for n, s, d in entries if is_lora_param(n)]
    peft_name = {n.replace(f".{ADAPTER}.", "."): n for n, _, _ in lora}
    write_safetensors(
        folder / "adapter_model.safetensors",
        [(n.replace(f".{ADAPTER}.", "."), s, d) for n, s, d in lora],
        lambda name: read(peft_name[name]),
        {},
    )
    config = peft_config.to_dict()
    config["base_model_name_or_path"] = None
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, default=list) + "\n")

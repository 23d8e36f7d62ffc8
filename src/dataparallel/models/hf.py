"""Hugging Face causal language models: a `save_pretrained` directory in, a model whose
parameters are filled in when (and where) the strategy asks.

    source = HFSource.open("path/to/dir", init="pretrained")   # one-line ValueError if not
    model = source.build(lora=LoraSpec.parse("r=8,alpha=16,targets=q_proj,v_proj"))
    fill = source.materializer(model, device)    # fill(params): those parameters get values
    fill(list(model.parameters()))               # all at once (DDP, ZeRO-1/2), or unit by
                                                 # unit under ZeRO-3 (`dp.ZeRO3(materialize=fill)`)

[Note: parameters on the meta device] `build` creates the model with every *parameter* on the
meta device (no memory) and every buffer real (rotary tables are computed in `__init__`, so a
meta buffer would be lost). `materializer` returns a callable that gives listed parameters
their values in place (`torch.utils.swap_tensors`: the same Python objects, so the strategies,
tied weights and peft's wrappers keep pointing at them): read from the directory's safetensors
one tensor at a time (`init="pretrained"`), or drawn by the model's own `_init_weights`
(`init="random"`; LoRA's A and B as peft initialises them). ZeRO-3 calls it unit by unit just
before sharding each unit, so no rank ever holds more than one unit's whole parameters.
Parameters are fp32 whatever the file stores; `--precision` decides what the compute runs in.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..torch_internals import replace_parameters
from .lora import LoraSpec, apply_lora, checkpoint_name, is_lora_param

HF_PREFIX = "hf:"
INITS = ("pretrained", "random")


def hf_path(model_name: str) -> Path | None:
    """The directory of an `hf:DIR` model name, or None for a built-in model."""
    return Path(model_name[len(HF_PREFIX) :]) if model_name.startswith(HF_PREFIX) else None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a `save_pretrained` directory (one, or the index's shards)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in shards]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


@dataclass(frozen=True)
class HFSource:
    """A checked `save_pretrained` directory.

    path: the directory.
    config: its `transformers` config (a causal LM's).
    init: "pretrained" (weights from the directory) or "random" (the config alone).
    """

    path: Path
    config: object
    init: str = "pretrained"

    @classmethod
    def open(cls, path: str | Path, init: str = "pretrained") -> HFSource:
        """Check the directory; raise ValueError, one line, naming what is wrong and the fix."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        path = Path(path)
        if init not in INITS:
            raise ValueError(f"init {init!r} is not one of {', '.join(INITS)}")
        if not path.is_dir():
            raise ValueError(
                f"{path} is not a directory; give a directory written by save_pretrained"
            )
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} holds no config.json, so it is not a model; give a directory written "
                "by save_pretrained"
            )
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as error:  # an unknown model_type, a broken JSON
            raise ValueError(f"{path}/config.json cannot be read ({first_line(error)})") from None
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(
                f"{path} is a {config.model_type!r} model, not a causal language model; give a "
                "model that AutoModelForCausalLM loads"
            )
        if init == "pretrained" and not weight_files(path):
            raise ValueError(
                f"{path} holds no model.safetensors; save it with save_pretrained(safe_"
                "serialization=True), or train from its config alone with --init random"
            )
        return cls(path, config, init)

    def build(self, lora: LoraSpec | None = None) -> nn.Module:
        """The model with its parameters on the meta device ([Note: parameters on the meta
        device]), LoRA adapters applied when `lora` is given (the base then frozen)."""
        from transformers import AutoModelForCausalLM

        self.config.use_cache = False  # training: no key/value cache in forward
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        model.requires_grad_(True)
        return apply_lora(model, lora) if lora is not None else model

    def materializer(self, model: nn.Module, device: torch.device | str = "cpu") -> Materializer:
        return Materializer(model, self, torch.device(device))


class Materializer:
    """Gives parameters on the meta device their values, in place (see the module's note).

    Collective-free and deterministic: every rank that fills the same parameter gets the same
    values from the file; a random initialisation depends on the RNG, so callers broadcast it.
    """

    def __init__(self, model: nn.Module, source: HFSource, device: torch.device):
        self.model, self.source, self.device = model, source, device
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.owner = {
            id(p): module for module in model.modules() for p in module.parameters(recurse=False)
        }
        self._readers: dict[Path, object] = {}
        self._where: dict[str, Path] | None = None
        self.filled = 0  # elements filled so far (tests count them)

    def __call__(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            if p.device.type != "meta":
                continue
            name = self.names[id(p)]
            value = self._initial(name, p) if self._random(name) else self._read(name, p)
            torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
            self.filled += p.numel()

    def _random(self, name: str) -> bool:
        return self.source.init == "random" or is_lora_param(name)

    def _initial(self, name: str, p: nn.Parameter) -> torch.Tensor:
        value = torch.empty(p.shape, dtype=torch.float32, device=self.device)
        if is_lora_param(name):  # peft's default: A Kaiming-uniform, B zero (an identity start)
            if ".lora_B." in name:
                return value.zero_()
            return nn.init.kaiming_uniform_(value, a=math.sqrt(5))
        module = self.owner[id(p)]
        holder = _base_model(self.model)
        # The model's own rule for the module that holds it (normal(0, initializer_range),
        # ones for norms, ...), applied to a stand-in module that holds only real tensors.
        stand_in = _stand_in(module, p, value)
        holder._init_weights(stand_in)
        return value

    def _read(self, name: str, p: nn.Parameter) -> torch.Tensor:
        key = self._key(checkpoint_name(name))
        if key is None:
            raise ValueError(
                f"parameter {name!r} is not in {self.source.path}'s weights; give the "
                "directory this model was saved to, or --init random"
            )
        reader = self._reader(self._where[key])
        tensor = reader.get_tensor(key)
        if tuple(tensor.shape) != tuple(p.shape):
            raise ValueError(
                f"parameter {name!r} is {tuple(p.shape)} in the config but "
                f"{tuple(tensor.shape)} in {self.source.path}'s weights; the config and the "
                "weights are from different models"
            )
        return tensor.to(device=self.device, dtype=torch.float32)

    def _key(self, name: str) -> str | None:
        if self._where is None:
            self._where = {}
            for file in weight_files(self.source.path):
                for key in self._reader(file).keys():
                    self._where[key] = file
        if name in self._where:
            return name
        prefix = _base_model(self.model).base_model_prefix + "."
        # A checkpoint of the bare model (no head) names its weights without the prefix.
        for other in (name.removeprefix(prefix), prefix + name):
            if other in self._where:
                return other
        return None

    def _reader(self, file: Path):
        if file not in self._readers:
            from safetensors import safe_open

            self._readers[file] = safe_open(str(file), framework="pt")
        return self._readers[file]


@contextlib.contextmanager
def parameters_on_meta():
    """Inside: every parameter a module registers goes to the meta device; buffers stay."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _stand_in(module: nn.Module, p: nn.Parameter, value: torch.Tensor) -> nn.Module:
    """A shallow copy of `module` whose parameters are real: `value` for `p`, scratch tensors
    for the others (their own turn fills them), so `_init_weights` runs on it unchanged."""
    clone = module.__new__(type(module))
    clone.__dict__ = dict(module.__dict__)
    replace_parameters(
        clone,
        lambda _, other: nn.Parameter(
            value if other is p else torch.empty(other.shape), requires_grad=False
        ),
    )
    return clone


def first_line(error: Exception) -> str:
    """An error's first line (its type's name when it says nothing), for one-line errors."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__

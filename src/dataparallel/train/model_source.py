"""The model a run trains: a built-in one by name, or a Hugging Face directory (`hf:DIR`).

    check_model(config)                   # before launch: ConfigError naming the field
    built = build_for_run(config, world)  # on every rank: model, the strategy, the tokenizer

[Note: a run's model] A built-in model is built whole on every rank (the same seed) and
broadcast by the strategy. An `hf:DIR` model is built with its parameters on the meta device
and filled from DIR (models/hf.py): under ZeRO-3 unit by unit as the strategy shards it
(`dp.ZeRO3(materialize=...)`), so no rank holds the whole model; under the other strategies,
which keep the whole model on every rank anyway, all at once before they start. Its
tokenizer is DIR's; the built-in models read bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import dataparallel as dp

from ..data.tokenizer import ByteTokenizer, HFTokenizer
from ..models import MODEL_CONFIGS, build_model
from ..models.hf import HFSource, first_line, hf_path
from .config import ConfigError, RunConfig, field_label


@dataclass
class BuiltModel:
    """What `build_for_run` gives the trainer.

    model: the model on the run's device (parameters on meta until the strategy fills them).
    strategy: what `dp.Recipe(strategy=...)` takes: the config's name, or a `dp.ZeRO3` that
        fills the parameters unit by unit.
    tokenizer: text to ids (bytes for the built-in models).
    name: the model's name in records and reports.
    source: the checked Hugging Face directory, or None for a built-in model.
    """

    model: nn.Module
    strategy: object
    tokenizer: object
    name: str
    source: HFSource | None = None


def short_name(config: RunConfig) -> str:
    """A name fit for a folder: the built-in name, or hf-<the directory's name>."""
    path = hf_path(config.model.name)
    return config.model.name if path is None else f"hf-{path.resolve().name}"


def open_source(config: RunConfig) -> HFSource:
    """The checked `hf:DIR` of the config (ConfigError on anything wrong with it)."""
    model = config.model
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            field_label("model", "name"),
            "Hugging Face models need transformers",
            'install them with pip install "dataparallel[hf]"',
        ) from None
    try:
        return HFSource.open(hf_path(model.name), model.init)
    except ValueError as error:
        field = "init" if "init" in str(error).split(" ")[0] else "name"
        raise ConfigError(
            field_label("model", field), str(error), "see docs/workloads.md"
        ) from None


def check_model(config: RunConfig) -> nn.Module:
    """Check the model fields against each other and the data; return the model built on the
    meta device (no memory), which the recipe's checks need (`dp.check_recipe`)."""
    model = config.model
    label = field_label("model", "name")
    if hf_path(model.name) is None:
        if model.name not in MODEL_CONFIGS:
            known = ", ".join(sorted(MODEL_CONFIGS))
            raise ConfigError(
                label, f"unknown value {model.name!r}", f"choose one of {known}, or hf:DIR"
            )
        for field, value, default in (("lora", model.lora, ""), ("init", model.init, "pretrained")):
            if value != default:
                raise ConfigError(
                    field_label("model", field), "applies to hf:DIR models only", "leave it out"
                )
        context = getattr(MODEL_CONFIGS[model.name], "block_size", None)
    else:
        source = open_source(config)
        context = getattr(source.config, "max_position_embeddings", None)
        check_tokenizer(source)
    meta = meta_model(config)
    if context and config.data.block_size > context:
        raise ConfigError(
            field_label("data", "block_size"),
            f"{config.data.block_size} exceeds {short_name(config)}'s context of {context}",
            f"use at most {context}",
        )
    return meta


def check_tokenizer(source: HFSource) -> None:
    """DIR holds a tokenizer whose ids all fit the model's vocabulary."""
    label = field_label("model", "name")
    try:
        tokenizer = HFTokenizer.load(source.path)
    except Exception as error:  # no tokenizer files, or unreadable ones
        raise ConfigError(
            label,
            f"{source.path} holds no tokenizer that AutoTokenizer loads ({first_line(error)})",
            "save the model's tokenizer there with tokenizer.save_pretrained(DIR)",
        ) from None
    vocab = getattr(source.config, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            label,
            f"{source.path}'s tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary only {vocab}",
            "save the tokenizer the model was trained with beside it",
        )


def meta_model(config: RunConfig) -> nn.Module:
    """The run's model with its parameters on the meta device (shapes, names; no memory)."""
    if hf_path(config.model.name) is None:
        with torch.device("meta"):
            return build_model(config.model.name)
    return _build_hf(config, open_source(config))


def _build_hf(config: RunConfig, source: HFSource) -> nn.Module:
    from ..models.lora import LoraSpec

    lora = None
    if config.model.lora:
        try:
            lora = LoraSpec.parse(config.model.lora)
        except ValueError as error:
            raise ConfigError(field_label("model", "lora"), str(error), "see --help") from None
    try:
        return source.build(lora=lora)
    except ValueError as error:  # targets that match no layer
        raise ConfigError(field_label("model", "lora"), str(error), "fix --lora") from None


def run_tokenizer(config: RunConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of the run's data (data/loading.py): an hf:DIR model's, else bytes."""
    path = hf_path(config.model.name)
    return ByteTokenizer() if path is None else HFTokenizer.load(path)


def build_for_run(config: RunConfig, world: dp.World) -> BuiltModel:
    """The run's model, the strategy that fills and shards it, and its tokenizer ([Note: a
    run's model]); every rank builds the same (the same seed)."""
    torch.manual_seed(config.train.seed)  # the same initial weights on every rank and run
    strategy = config.launch.strategy
    if hf_path(config.model.name) is None:
        model = build_model(config.model.name).to(world.device)
        return BuiltModel(model, strategy, ByteTokenizer(), config.model.name)
    source = open_source(config)
    model = _build_hf(config, source)
    fill = source.materializer(model, world.device)
    if strategy == "zero3":
        strategy = dp.ZeRO3(materialize=fill)
    else:
        fill(list(model.parameters()))
    tokenizer = HFTokenizer.load(source.path)
    return BuiltModel(model, strategy, tokenizer, short_name(config), source)

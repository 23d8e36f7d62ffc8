"""The model a run trains: a built-in one by name, or a Hugging Face directory (`hf:DIR`).

    source = RunModel(config.model)            # once per process: the name read, DIR opened
    check_model(config, source)                   # before launch: ConfigError naming the field
    built = build_for_run(config, world, source)  # on every rank: model, strategy, tokenizer

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
from .config import ConfigError, ModelConfig, RunConfig, field_label


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


class RunModel:
    """The run's model as [model] names it, resolved once per process and passed down: the
    name read once (`hf_path`), an hf:DIR opened and checked once, its tokenizer loaded once.

    model: the [model] section.
    path: the hf:DIR directory, or None for a built-in model.
    """

    def __init__(self, model: ModelConfig):
        self.model = model
        self.path = hf_path(model.name)  # the one place the name is read
        self._opened: HFSource | None = None
        self._tokenizer = None

    @property
    def short_name(self) -> str:
        """A name fit for a folder: the built-in name, or hf-<the directory's name>."""
        return self.model.name if self.path is None else f"hf-{self.path.resolve().name}"

    def opened(self) -> HFSource:
        """The checked hf:DIR (ConfigError on anything wrong with it), opened once."""
        if self._opened is None:
            self._opened = self._open()
        return self._opened

    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        """The tokenizer of the run's data (data/loading.py): an hf:DIR model's, loaded once,
        else bytes."""
        if self._tokenizer is None:
            self._tokenizer = ByteTokenizer() if self.path is None else HFTokenizer.load(self.path)
        return self._tokenizer

    def meta_model(self) -> nn.Module:
        """The run's model with its parameters on the meta device (shapes, names; no memory)."""
        if self.path is None:
            with torch.device("meta"):
                return build_model(self.model.name)
        return self._build_hf()

    def _open(self) -> HFSource:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError(
                field_label("model", "name"),
                "Hugging Face models need transformers",
                'install them with pip install "dataparallel[hf]"',
            ) from None
        try:
            return HFSource.open(self.path, self.model.init)
        except ValueError as error:
            field = "init" if "init" in str(error).split(" ")[0] else "name"
            raise ConfigError(
                field_label("model", field), str(error), "see docs/workloads.md"
            ) from None

    def _build_hf(self) -> nn.Module:
        from ..models.lora import LoraSpec

        lora = None
        if self.model.lora:
            try:
                lora = LoraSpec.parse(self.model.lora)
            except ValueError as error:
                raise ConfigError(field_label("model", "lora"), str(error), "see --help") from None
        try:
            return self.opened().build(lora=lora)
        except ValueError as error:  # targets that match no layer
            raise ConfigError(field_label("model", "lora"), str(error), "fix --lora") from None


def check_model(config: RunConfig, source: RunModel) -> nn.Module:
    """Check the model fields against each other and the data; return the model built on the
    meta device (no memory), which the recipe's checks need (`dp.check_recipe`)."""
    model = config.model
    label = field_label("model", "name")
    if source.path is None:
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
        opened = source.opened()
        context = getattr(opened.config, "max_position_embeddings", None)
        check_tokenizer(source)
    meta = source.meta_model()
    if config.train.activation_checkpointing:
        try:
            dp.checkpoint_activations(meta)
        except ValueError as error:
            raise ConfigError(
                field_label("train", "activation_checkpointing"),
                f"{model.name} has no blocks to recompute ({error})",
                "leave it out, or train a GPT (gpt-tiny, gpt-small, gpt-medium) or hf:DIR",
            ) from None
    if context and config.data.block_size > context:
        raise ConfigError(
            field_label("data", "block_size"),
            f"{config.data.block_size} exceeds {source.short_name}'s context of {context}",
            f"use at most {context}",
        )
    return meta


def check_tokenizer(source: RunModel) -> None:
    """DIR holds a tokenizer whose ids all fit the model's vocabulary."""
    label = field_label("model", "name")
    try:
        tokenizer = source.tokenizer()
    except Exception as error:  # no tokenizer files, or unreadable ones
        raise ConfigError(
            label,
            f"{source.path} holds no tokenizer that AutoTokenizer loads ({first_line(error)})",
            "save the model's tokenizer there with tokenizer.save_pretrained(DIR)",
        ) from None
    vocab = getattr(source.opened().config, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            label,
            f"{source.path}'s tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary only {vocab}",
            "save the tokenizer the model was trained with beside it",
        )


def build_for_run(config: RunConfig, world: dp.World, source: RunModel) -> BuiltModel:
    """The run's model, the strategy that fills and shards it, and its tokenizer ([Note: a
    run's model]); every rank builds the same (the same seed)."""
    torch.manual_seed(config.train.seed)  # the same initial weights on every rank and run
    strategy = config.launch.strategy
    if source.path is None:
        model = build_model(config.model.name).to(world.device)
        return BuiltModel(model, strategy, source.tokenizer(), config.model.name)
    model = source.meta_model()
    opened = source.opened()
    fill = opened.materializer(model, world.device)
    if strategy == "zero3":
        strategy = dp.ZeRO3(materialize=fill)
    else:
        fill(list(model.parameters()))
    return BuiltModel(model, strategy, source.tokenizer(), source.short_name, opened)

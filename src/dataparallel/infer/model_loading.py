"""What `dataparallel generate | eval | sample` run on: a model and its tokenizer, from a path.

The path (RUN_OR_DIR) is one of:
- a save_pretrained directory (config.json in it): `AutoModelForCausalLM.from_pretrained` and
  the tokenizer saved beside it (`HFTokenizer.load`);
- a run directory that holds one as `hf/` (the export of a run that trained an HF model);
- a run directory of `dataparallel train` with a built-in byte GPT (model.safetensors), or that
  .safetensors file itself: the model rebuilt from the file's metadata, the `ByteTokenizer`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

import dataparallel as dp

from ..checkpoint import read_weights_metadata
from ..data.tokenizer import ByteTokenizer, HFTokenizer
from ..launch.config import ConfigError
from ..models import MODEL_CONFIGS
from ..models.hf import HFSource
from .sampling import load_trained_model, weights_path

FIELD = "RUN_OR_DIR"


@dataclass(frozen=True)
class ModelSource:
    """Where a model is: kind "hf" (a save_pretrained directory) or "gpt" (a weights file)."""

    kind: str
    path: Path


@dataclass
class LoadedModel:
    """A model ready for inference.

    model: in eval mode; maps token ids (batch, time) to logits (through `logits`).
    tokenizer: a ByteTokenizer or an HFTokenizer.
    kind: "hf" or "gpt".
    context: the longest sequence the model takes (the GPT's block_size; an HF model's
        max_position_embeddings when its config has one, else 0: no limit known).
    stop_ids: token ids that end a completion (the HF tokenizer's / config's eos; none for bytes).
    pad_id: the id that fills left padding (masked out, so any id works).
    """

    model: torch.nn.Module
    tokenizer: object
    kind: str
    context: int
    stop_ids: frozenset[int]
    pad_id: int


def find_model(path: str | Path) -> ModelSource:
    """The model a RUN_OR_DIR names, or a ConfigError saying what the path holds instead."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(FIELD, f"{path} does not exist", "give a run directory or a model")
    if (path / "config.json").is_file():
        return ModelSource("hf", path)
    if (path / "hf" / "config.json").is_file():
        return ModelSource("hf", path / "hf")
    if weights_path(path).is_file():
        return ModelSource("gpt", weights_path(path))
    raise ConfigError(
        FIELD,
        f"{path} holds no model (no config.json, hf/config.json or model.safetensors)",
        "give a run directory of dataparallel train or a save_pretrained directory",
    )


def load_model(source: ModelSource, sharded: bool = False) -> LoadedModel:
    """Load the model and tokenizer `source` names, in eval mode (ConfigError when unusable).

    sharded: parallelize it with ZeRO-3 (collective: every rank calls it). A Hugging Face model
    is then filled unit by unit as it is sharded (`dp.ZeRO3(materialize=...)`, models/hf.py),
    so no rank ever holds all of it."""
    if source.kind == "gpt":
        try:
            model, metadata = load_trained_model(source.path)
        except Exception as error:  # not a safetensors file, or not one of ours
            raise ConfigError(FIELD, str(error), "give a run of dataparallel train") from None
        block = metadata.get("model_config", {}).get("block_size") or model.config.block_size
        if sharded:
            model = dp.parallelize(model, "zero3")
        return LoadedModel(model, ByteTokenizer(), "gpt", int(block), frozenset(), 0)
    return _load_hf(source.path, sharded)


def check_model(source: ModelSource) -> None:
    """Check what can be checked before loading the weights (cheap: metadata, config, tokenizer);
    ConfigError when the model is unusable."""
    if source.kind == "gpt":
        try:
            metadata = read_weights_metadata(source.path)
        except Exception as error:  # noqa: BLE001 - not a safetensors file
            raise ConfigError(FIELD, f"{source.path}: {error}", "give a run of train") from None
        if metadata.get("model") not in MODEL_CONFIGS:
            raise ConfigError(
                FIELD,
                f"{source.path} holds no built-in model (model={metadata.get('model')!r})",
                "give a run of dataparallel train, or a save_pretrained directory",
            )
    else:
        _hf_tokenizer(source.path)


def _hf_tokenizer(path: Path) -> tuple[dict, HFTokenizer]:
    """(config.json, the tokenizer), checked against each other."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(FIELD, f"{path}/config.json: {error}", "check the export") from None
    try:
        tokenizer = HFTokenizer.load(path)
    except Exception as error:  # noqa: BLE001 - no tokenizer files, or broken ones
        raise ConfigError(
            FIELD, f"{path} has no usable tokenizer ({error})", "save the tokenizer beside it"
        ) from None
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)
    if vocab and tokenizer.vocab_size > vocab:
        raise ConfigError(
            FIELD,
            f"the tokenizer in {path} has {tokenizer.vocab_size} tokens, the model {vocab}",
            "save the tokenizer the model was trained with",
        )
    return config, tokenizer


def _load_hf(path: Path, sharded: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank and per file otherwise
    config, tokenizer = _hf_tokenizer(path)
    try:
        if sharded:
            hf_source = HFSource.open(path)
            model = hf_source.build()
            model.config.use_cache = True  # build() turns it off for training
            fill = hf_source.materializer(model)
            model = dp.parallelize(model, dp.ZeRO3(materialize=fill))
        else:
            model = AutoModelForCausalLM.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - not a causal LM, missing weights...
        raise ConfigError(
            FIELD, f"{path} is not a causal LM transformers can load ({error})", "check the export"
        ) from None
    stop = config.get("eos_token_id")
    stop_ids = set(stop if isinstance(stop, list) else [stop] if stop is not None else [])
    if tokenizer.eos_id is not None:
        stop_ids.add(tokenizer.eos_id)
    hf = tokenizer.hf
    pad = hf.pad_token_id if hf.pad_token_id is not None else tokenizer.eos_id
    context = int(config.get("max_position_embeddings") or config.get("n_positions") or 0)
    return LoadedModel(model.eval(), tokenizer, "hf", context, frozenset(stop_ids), pad or 0)


def logits(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """Logits (batch, time, vocab) of unpadded token ids (batch, time), for either kind."""
    if loaded.kind == "gpt":
        return loaded.model(ids)
    return loaded.model(input_ids=ids, use_cache=False).logits

"""The models of gpu_throughput.py: a Llama by size, its batch, its FLOPs and the planner's peak.

A size is a `plan.llama.LlamaConfig` (the planner's own shapes) built as Hugging Face's
`LlamaForCausalLM` from a config: random initialisation, SDPA attention. "1b" is Llama 3.2 1B
(the planner's llama-1b, tied head) at sequence 2048; "8b" is Llama 3 8B (llama-8b) for the
LoRA case; "toy" and "toy-lora" stand in for them on a CPU, in the suite.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dataparallel import Recipe
from dataparallel.models.lora import LoraSpec
from dataparallel.plan.flops import module_flops_per_token
from dataparallel.plan.inputs import PlanInputs
from dataparallel.plan.llama import LLAMA_CONFIGS, LlamaConfig
from dataparallel.plan.model import llama_shape
from dataparallel.plan.planner import make_plan
from dataparallel.plan.profiles import get_profile

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the LoRA sizes' adapted layers

TOY = LlamaConfig(
    dim=64, n_layer=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=64
)


@dataclass(frozen=True)
class Size:
    """A model and its batch.

    name: how the table names it.
    config: the Llama's shape (the planner's `LlamaConfig`); `seq_len` is the training sequence.
    batch: samples per step (one rank).
    lora: LoRA adapters' rank on q, k, v and o (0: a full fine-tune).
    """

    name: str
    config: LlamaConfig
    batch: int
    lora: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.config.seq_len


SIZES = {
    # batch 4: the planner's peak 50 GB under DDP (bf16 autocast), 100 GB at 8 (too close to
    # an H100's 80 GB, and to an H200's 139 GiB if Hugging Face's modules keep more than its own)
    "1b": Size("llama-1b", replace(LLAMA_CONFIGS["llama-1b"], seq_len=2048), batch=4),
    "toy": Size("toy", TOY, batch=4),
    "8b-lora": Size("llama-8b", replace(LLAMA_CONFIGS["llama-8b"], seq_len=2048), 1, lora=16),
    "toy-lora": Size("toy", TOY, batch=4, lora=4),
}


def hf_config(c: LlamaConfig):
    """The Hugging Face config of a planner Llama (Llama 3's RoPE base, SDPA attention)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        max_position_embeddings=max(c.seq_len, 2048),
        rope_theta=500_000.0,
        tie_word_embeddings=c.tie_weights,
        attn_implementation="sdpa",
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build(size: Size, device: torch.device, dtype: torch.dtype = torch.float32):
    """The model, random from seed 0 (the same weights for every contender), on `device`;
    with `size.lora`, peft's LoRA adapters on the attention's projections (base frozen)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` on `device`: an 8B never exists in fp32
    try:
        with device:
            model = LlamaForCausalLM(hf_config(size.config))
    finally:
        torch.set_default_dtype(previous)
    if size.lora:
        from peft import LoraConfig, get_peft_model

        targets = list(LORA_TARGETS)
        adapters = LoraConfig(r=size.lora, lora_alpha=2 * size.lora, target_modules=targets)
        model = get_peft_model(model, adapters)
    return model


def batch(size: Size, device: torch.device) -> torch.Tensor:
    """The one batch every contender trains on: ids (batch, seq), seed 0; labels are the ids
    (the model shifts them)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size.config.vocab_size, (size.batch, size.config.seq_len), generator=g)
    return ids.to(device)


def flops_per_token(size: Size) -> float:
    """torchtitan's count ([Note: MFU] in plan/flops.py) of the size's model, built on meta."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(size.config))
    c = size.config
    return module_flops_per_token(model, c.n_layer, c.dim, c.seq_len)


def planned_peak(size: Size, strategy: str, precision: str, hardware: str = "h200") -> float:
    """The planner's peak bytes (`dataparallel plan`'s peak column) for one rank of `strategy`
    in `precision` on the size's model, micro-batch and sequence; a LoRA size with its
    adapters as `build` puts them ([Note: planner LoRA] in plan/lora.py)."""
    lora = LoraSpec(r=size.lora, alpha=2 * size.lora, targets=LORA_TARGETS) if size.lora else None
    recipe = Recipe(precision=precision)
    inputs = PlanInputs(ranks=1, recipe=recipe, micro_batch=size.batch, strategies=(strategy,))
    compute = inputs.compute
    autocast = torch.bfloat16 if inputs.autocast else None
    shape = llama_shape(size.name, size.config, size.config.seq_len, compute, autocast, lora=lora)
    return make_plan(shape, get_profile(hardware), inputs).rows[0].peak_bytes


def write_hf_dir(size: Size, path: Path) -> Path:
    """A `save_pretrained`-style directory for `dataparallel train --model hf:DIR --init
    random`: the size's config and a byte-level tokenizer (256 ids, no merges: it fits every
    vocabulary here), nothing downloaded. No weights (--init random needs none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    hf_config(size.config).save_pretrained(path)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path


def write_tokens(size: Size, path: Path, steps: int) -> Path:
    """Random token ids below 256 (the tokenizer's) for `steps` steps and a validation split,
    as a `.npy` file the job reads memory-mapped."""
    import numpy as np

    n = (steps + 4) * size.batch * (size.config.seq_len + 1) * 2
    ids = np.random.default_rng(0).integers(0, 256, size=n, dtype=np.uint16)
    np.save(path, ids)
    return path


PEAK_PROBE = Path(__file__).with_name("peak_probe")
PEAK_ENV = "DP_BENCH_PEAK_FILE"


def read_probed_peak(prefix: str) -> int | None:
    """The largest CUDA peak a process under the probe (peak_probe/sitecustomize.py) wrote
    to `prefix`.<pid>, or None (no CUDA, or nothing written)."""
    folder, stem = os.path.split(prefix)
    peaks = []
    for name in os.listdir(folder or "."):
        if name.startswith(os.path.basename(stem) + "."):
            try:
                peaks.append(json.loads(Path(folder, name).read_text()))
            except (OSError, ValueError):
                continue
    return max(peaks) if peaks else None

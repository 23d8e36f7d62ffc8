"""Hugging Face fixtures built here, never downloaded: a byte-level BPE tokenizer trained on
standard-library source, and tiny causal LMs (Llama, GPT-2) saved with `save_pretrained`.

    tok_dir = make_tokenizer(tmp_path / "tok")          # a tokenizer directory
    model_dir = make_tiny_llama(tmp_path / "llama")     # weights, config and the tokenizer

Both are deterministic (fixed seeds, sorted inputs), so two calls give the same files.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

VOCAB = 384  # 256 bytes + merges + the special tokens
SPECIALS = ["<|endoftext|>", "<|pad|>"]
# A minimal chat template: each message on its own line, a generation prompt for the assistant.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SOURCES = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py", "shlex.py"]


def training_text() -> list[str]:
    """A few standard-library files: real text that every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text() for name in _SOURCES]


def make_tokenizer(path: Path, vocab: int = VOCAB) -> Path:
    """Train a byte-level BPE tokenizer and save it as a `PreTrainedTokenizerFast` directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=SPECIALS[0], pad_token=SPECIALS[1]
    )
    fast.chat_template = CHAT_TEMPLATE
    path = Path(path)
    fast.save_pretrained(path)
    return path


def make_tiny_llama(path: Path, *, seed: int = 0, layers: int = 2, width: int = 32) -> Path:
    """A tiny Llama (random weights from `seed`) and its tokenizer, saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer_dir = make_tokenizer(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path


def make_tiny_gpt2(path: Path, *, seed: int = 0, layers: int = 2, width: int = 32) -> Path:
    """A tiny GPT-2 (tied embeddings) and its tokenizer, saved to `path`."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(make_tokenizer(path))
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=width,
        n_layer=layers,
        n_head=4,
        n_positions=256,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


class Counting:
    """A tokenizer that counts the texts it encodes (to see whether the cache was read)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return self.inner.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.calls += len(texts)
        return self.inner.encode_batch(texts)

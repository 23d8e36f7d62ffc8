"""Tokenizers: text to token ids and back, with a fingerprint that keys the token caches.

    tokenizer = ByteTokenizer()                  # the built-in models: one token per byte
    tokenizer = HFTokenizer.load("path/to/dir")  # a Hugging Face tokenizer directory

Both give `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `eos_id` (the
token put between packed documents, or None) and `fingerprint`: a hash of everything that
decides the ids a text gets, so a cache of token ids written with one tokenizer is never read
with another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


class ByteTokenizer:
    """The built-in models' tokenizer: the UTF-8 bytes of the text, one token each (256 ids)."""

    vocab_size = 256
    eos_id = None  # byte corpora are concatenated as they are ([Note: corpus split])
    fingerprint = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (`AutoTokenizer.from_pretrained(dir)`), wrapped.

    hf: the transformers tokenizer itself (for its chat template, special tokens, ...).
    fingerprint: sha256 of its files' contents (tokenizer.json, its config, the chat template).
    """

    def __init__(self, hf, fingerprint: str):
        self.hf = hf
        self.fingerprint = fingerprint

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        hf = AutoTokenizer.from_pretrained(path)
        digest = hashlib.sha256()
        for name in sorted(p.name for p in path.iterdir() if _decides_ids(p.name)):
            digest.update(name.encode() + b"\0" + (path / name).read_bytes())
        digest.update(json.dumps(sorted(hf.get_vocab().items())).encode())
        return cls(hf, "hf-" + digest.hexdigest()[:16])

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


def _decides_ids(name: str) -> bool:
    """Files of a tokenizer directory that decide which ids a text gets."""
    return name.startswith("tokenizer") or name in {
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
    }

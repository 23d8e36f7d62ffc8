"""Tokenizers: text to token ids and back, with a fingerprint that keys the token caches.

    tokenizer = ByteTokenizer()                  # the built-in models: one token per byte
    tokenizer = HFTokenizer.load("path/to/dir")  # a Hugging Face tokenizer directory

Both give `encode(text) -> list[int]` (and `encode_batch(texts)`), `decode(ids) -> str`, `vocab_size`, `eos_id` (the
token put between packed documents, or None) and `fingerprint`: a hash of everything that
decides the ids a text gets, so a cache of token ids written with one tokenizer is never read
with another. `render_chat(messages)` turns a conversation into (text, is_completion) segments
through the tokenizer's chat template; `has_chat_template` says whether there is one.
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    has_chat_template = False

    def render_chat(self, messages: list[dict]) -> list[tuple[str, bool]]:
        raise ValueError("the byte tokenizer has no chat template")


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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, the batch at once (on threads, for a fast tokenizer)."""
        return self.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The conversation as (text, is_completion) segments whose concatenation is the chat
        template's rendering; is_completion marks the assistant's replies (with the template's
        end-of-turn text), not the headers that open them.

        Renders growing prefixes of the conversation: an assistant reply i is what
        render(messages[: i + 1]) adds to render(messages[:i], add_generation_prompt=True), so
        the template must render a conversation's start the same as the whole (ValueError if not).
        """
        if not self.has_chat_template:
            raise ValueError("the tokenizer has no chat template")
        segments: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            assistant = message.get("role") == "assistant"
            if assistant:
                header = self._render(messages[:i], generation_prompt=True)
                segments.append((self._after(done, header), False))
                done = header
            text = self._render(messages[: i + 1], generation_prompt=False)
            segments.append((self._after(done, text), assistant))
            done = text
        merged: list[tuple[str, bool]] = []
        for text, is_completion in segments:  # one segment per run of the same kind
            if merged and merged[-1][1] == is_completion:
                merged[-1] = (merged[-1][0] + text, is_completion)
            elif text:
                merged.append((text, is_completion))
        return merged

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        if not messages and not generation_prompt:
            return ""
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    @staticmethod
    def _after(prefix: str, text: str) -> str:
        if not text.startswith(prefix):
            raise ValueError(
                "the chat template renders the start of a conversation differently from the "
                "whole, so the assistant's replies cannot be told apart"
            )
        return text[len(prefix) :]


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

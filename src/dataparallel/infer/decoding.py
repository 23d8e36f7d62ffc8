"""Decoding a batch of prompts with exactly `tokens` forwards, greedy or sampled.

[Note: forwards in step] Under ZeRO-3 every forward gathers each unit's parameters with a
collective, so every rank must run the same number of forwards through the same units, in the
same order ([Note: same units on every rank] in strategies/zero3/order.py). Decoding therefore
never stops early: a batch always runs `tokens` forwards (a row that reached its stop token
goes on, and its completion is cut at the stop token afterwards; rows are independent, so that
changes no other row), and a rank with fewer batches runs stand-in batches (generate.py).

Hugging Face models decode with their key/value cache: one forward of the left-padded prompts
with an attention mask and position ids that start at each row's first real token (as
`model.generate` does), then one forward per new token. The built-in GPTs take no mask, so
their batches hold prompts of one length (generate.py groups them) and each step runs the
last `context` tokens again, as `dataparallel sample` does.

Sampling draws each row from its own generator, seeded with (seed, the prompt's index in the
file), so a prompt gets the same completion whichever rank or batch it lands in.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .model_loading import LoadedModel


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen.

    temperature: 0 chooses the likeliest token (greedy, the default); above 0 samples from the
        softmax of logits / temperature.
    top_k: when sampling, among the k likeliest tokens only; 0: among all.
    seed: seeds each prompt's generator (with the prompt's index).
    """

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def choose(self, logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """The next token of each row of `logits` (batch, vocab)."""
        logits = logits.float()
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        rows = [
            torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)
        ]
        return torch.cat(rows)

    def generators(self, indices: list[int]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(self.seed * 1_000_003 + i) for i in indices]


@torch.no_grad()
def decode(
    loaded: LoadedModel,
    prompts: list[list[int]],
    indices: list[int],
    tokens: int,
    sampling: Sampling,
) -> list[list[int]]:
    """The `tokens` new ids of each prompt (each cut at its first stop id), `tokens` forwards."""
    generators = sampling.generators(indices)
    if loaded.kind == "hf":
        new = _decode_hf(loaded, prompts, tokens, sampling, generators)
    else:
        new = _decode_gpt(loaded, prompts, tokens, sampling, generators)
    return [cut_at_stop(row, loaded.stop_ids) for row in new.tolist()]


def cut_at_stop(ids: list[int], stop_ids: frozenset[int]) -> list[int]:
    """`ids` up to (without) the first stop id."""
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[:position]
    return ids


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each (batch, longest prompt), the prompts aligned on the right."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
    return ids, mask


def _decode_hf(loaded, prompts, tokens, sampling, generators) -> torch.Tensor:
    device = next(loaded.model.parameters()).device
    ids, mask = left_pad(prompts, loaded.pad_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each row counts from its first real token
    out = loaded.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache_name = _cache_name(loaded.model)
    chosen = []
    for step in range(tokens):
        next_ids = sampling.choose(out.logits[:, -1, :], generators).to(device)
        chosen.append(next_ids)
        if step == tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = loaded.model(
            input_ids=next_ids[:, None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache_name: getattr(out, cache_name)},
        )
    return torch.stack(chosen, dim=1).cpu()


def _cache_name(model) -> str:
    """The name of the key/value cache, in and out: "cache" (transformers >= 5.2x), or
    "past_key_values" (before, deprecated since)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decode_gpt(loaded, prompts, tokens, sampling, generators) -> torch.Tensor:
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("decode: a built-in GPT's batch must hold prompts of one length")
    device = next(loaded.model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    start = ids.shape[1]
    for _ in range(tokens):
        logits = loaded.model(ids[:, -loaded.context :])[:, -1, :]
        ids = torch.cat([ids, sampling.choose(logits, generators).to(device)[:, None]], dim=1)
    return ids[:, start:].cpu()

"""Llama-shaped decoders for the planner's cluster tables and its dry run (Touvron et al.
2023; Llama 3's sizes from Meta's published model configs: RMSNorm, grouped-query attention
with rotary position embeddings, SwiGLU, untied output head except for the 1B). Built on the
meta device for the planner; the forward runs there (the dry run, plan/dry_run.py) and, for a
tiny config, on CPU.

[Note: local heads, Llama] Under a tensor-parallel split (plan/tensor_parallel.py `narrow`)
wq, wk, wv hold whole heads of a rank's share: the forward reads its numbers of query and
key-value heads from the widths it computed, never from the config (as models/gpt.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

ROPE_THETA = 500_000.0  # Llama 3's rotary base


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama.

    dim: residual width. n_layer: blocks. n_heads / n_kv_heads: query and key-value heads.
    ffn_dim: SwiGLU hidden width. vocab_size: tokens. seq_len: training sequence length.
    tie_weights: share the output head with the token embedding (Llama 3.2 1B does).
    """

    dim: int
    n_layer: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 128_256
    seq_len: int = 8192
    tie_weights: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA_CONFIGS = {
    "llama-1b": LlamaConfig(
        dim=2048, n_layer=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_weights=True
    ),
    "llama-8b": LlamaConfig(dim=4096, n_layer=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "llama-70b": LlamaConfig(dim=8192, n_layer=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


def rotary(seq_len: int, head_dim: int, device, theta: float = ROPE_THETA):
    """cos and sin of RoPE's angles (Su et al. 2021), seq_len x head_dim / 2, in fp32."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inverse)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x's (batch, heads, seq, head_dim) pairs (first half, second half) by RoPE."""
    half = x.shape[-1] // 2
    a, b = x.float()[..., :half], x.float()[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + SwiGLU(norm(x))."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        kv = c.head_dim * c.n_kv_heads
        self.head_dim = c.head_dim
        self.attention_norm = nn.RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, kv, bias=False)
        self.wv = nn.Linear(c.dim, kv, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal grouped-query attention: each key-value head serves heads / kv_heads query
        heads ([Note: local heads, Llama])."""
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        heads, kv_heads = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q = q.view(batch, seq, heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); seq up to any length (RoPE)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_weights:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        cos, sin = rotary(tokens.shape[1], self.head_dim, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

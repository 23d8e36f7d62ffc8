"""Llama-shaped decoders for the planner's cluster tables, built on the meta device only
(Touvron et al. 2023; Llama 3's sizes from Meta's published model configs: RMSNorm,
grouped-query attention, SwiGLU, untied output head except for the 1B)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


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


LLAMA_CONFIGS = {
    "llama-1b": LlamaConfig(dim=2048, n_layer=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                            tie_weights=True),
    "llama-8b": LlamaConfig(dim=4096, n_layer=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "llama-70b": LlamaConfig(dim=8192, n_layer=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}  # fmt: skip


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        kv = c.dim // c.n_heads * c.n_kv_heads
        self.attention_norm = nn.RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, kv, bias=False)
        self.wv = nn.Linear(c.dim, kv, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)


class Llama(nn.Module):
    """Parameters only: the planner counts them and never runs this forward."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_weights:
            self.output.weight = self.tok_embeddings.weight

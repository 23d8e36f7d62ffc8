"""A GPT-style decoder (nanoGPT's shape): token + position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final norm, and an output head tied to the embedding.

Byte-level by default (vocab 256), so any text trains without a tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..torch_internals import add_load_state_dict_pre_hook


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model.

    vocab_size: number of token ids (256 for bytes).
    block_size: longest sequence the position embedding covers.
    n_layer: transformer blocks.
    n_head: attention heads per block (must divide n_embd).
    n_embd: width of the residual stream.
    dropout: dropout probability (0 keeps runs bit-for-bit deterministic).
    tie_weights: share the output head's weight with the token embedding.
    bias: give the linear layers biases (GPT-2 does). Note that the attention's key bias has an
        exactly zero true gradient (softmax ignores a constant added to every score).
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate query, key and value projections.

    [Note: local heads] Under tensor parallelism (`GPT.tensor_parallel_plan`) q, k and v are
    split by output rows (ColwiseParallel) and `proj` by input columns (RowwiseParallel), so a
    rank holds whole heads: the forward reads the number of heads from the output width it
    computed (the local one), never from the config. Separate q, k, v (rather than one fused
    qkv) keep each rank's rows whole heads; a state dict of the fused form still loads.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        add_load_state_dict_pre_hook(self, _split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (
            t.view(batch, time, -1, self.head_dim).transpose(1, 2)  # -1: the local heads
            for t in (self.q(x), self.k(x), self.v(x))
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


def _split_fused_qkv(state_dict, prefix, *args) -> None:
    """Load a state dict saved with the fused `qkv` projection (before [Note: local heads])."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3), strict=True):
                state_dict[f"{prefix}{name}.{kind}"] = part


class Block(nn.Module):
    """One transformer block: the natural unit for ZeRO-3 to gather and free."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for token ids of shape (batch, time)."""
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"GPT: sequence length {time} exceeds block_size={self.config.block_size}"
            )
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def tensor_parallel_plan(self, tp: int) -> dict:
        """PyTorch's `parallelize_module` plan that splits the model over a "tp" mesh dimension
        of `tp` ranks (`dp.Recipe(tp=...)`, [Note: local heads]): in each block q, k, v and the
        MLP's first linear by output rows (ColwiseParallel), the attention's output projection
        and the MLP's second linear by input columns (RowwiseParallel), so each rank computes its
        heads and its slice of the MLP and one all-reduce per sub-layer and direction joins
        them. Embeddings, norms and the head stay whole (replicated over "tp"). ValueError when
        `tp` does not divide the heads (and so the width)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        for what, size in (("heads", self.config.n_head), ("width", self.config.n_embd)):
            if size % tp:
                raise ValueError(f"{tp} does not divide the GPT's {size} {what}")
        block = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        }
        return {f"blocks.*.{name}": style for name, style in block.items()}  # every block

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0
    ) -> torch.Tensor:
        """Extend `idx` (batch, time) by sampling `max_new_tokens` tokens."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :] / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

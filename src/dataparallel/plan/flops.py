"""Model FLOPs per token and MFU, as torchtitan counts them (its
`get_dense_model_nparams_and_flops` and `get_peak_flops`).

[Note: MFU] FLOPs per token = 6 x (parameters - embedding parameters) + 12 x layers x width x
sequence length: 2 FLOPs per weight and token forward, 4 backward (PaLM's count, Chowdhery et
al. 2022, appendix B), the embedding lookup free, and attention's two matrix products, q k^T
and the weighted sum over v, 12 x width x sequence per layer forward and backward; no credit
for recomputation (activation checkpointing's extra forward is not counted). MFU = tokens/s x
FLOPs per token / the device's dense peak. A tied output head shares the embedding's parameter,
so its matrix product is not counted either (torchtitan counts parameters once). The planner's
own `ModelShape.flops_per_token` (model.py) counts the weights of linear layers instead, a tied
head once per use and the norms not at all: the same figure for an untied Llama to 0.01% (Llama 3 8B: 0.003%).
"""

from __future__ import annotations

from torch import nn

FORMULA = (
    "MFU = tokens/s x FLOPs per token / peak FLOP/s; FLOPs per token = "
    "6 x (parameters - embedding parameters) + 12 x layers x width x sequence length "
    "(torchtitan's count, no credit for recomputation)"
)
# Dense BF16 peak FLOP/s by device name, as torchtitan's `get_peak_flops` has them (H100 SXM
# datasheet; the H200 has the H100's compute with more, faster memory).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}


def flops_per_token(
    params: int, embedding_params: int, layers: int, width: int, seq_len: int
) -> float:
    """Training FLOPs per token ([Note: MFU])."""
    return 6.0 * (params - embedding_params) + 12.0 * layers * width * seq_len


def module_flops_per_token(model: nn.Module, layers: int, width: int, seq_len: int) -> float:
    """`flops_per_token` of `model`: its parameters counted once (frozen ones too), the
    parameters of its `nn.Embedding` modules as the embedding's. Works on the meta device."""
    params = sum(p.numel() for p in model.parameters())
    embedding: dict[int, int] = {}  # by id: an embedding shared by two modules counts once
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            embedding.update((id(p), p.numel()) for p in module.parameters())
    return flops_per_token(params, sum(embedding.values()), layers, width, seq_len)


def mfu(tokens_per_s: float, flops: float, peak: float) -> float:
    """Model FLOPs utilisation: the share of `peak` FLOP/s that `tokens_per_s` tokens of
    `flops` FLOPs each make ([Note: MFU])."""
    return tokens_per_s * flops / peak


def peak_flops(device_name: str) -> float | None:
    """The dense BF16 peak of a device by its name (`torch.cuda.get_device_name()`), or None
    for a device not in `PEAK_FLOPS` (a CPU)."""
    for key, peak in PEAK_FLOPS.items():
        if key in device_name:
            return peak
    return None

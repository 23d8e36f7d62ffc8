"""What the planner knows about a model: its parameter sizes, its shape, its FLOPs and the
bytes its forward keeps for backward. Nothing is allocated: modules are built and run on the
meta device.

[Note: activations] A built-in model or an nn.Module with an example input is *traced*: its
forward and loss run on meta tensors under `saved_tensors_hooks`, and every distinct storage
autograd keeps (parameters excepted) is counted: exactly what a real run keeps, in the
compute dtype, for this torch. Attention goes through the flash kernel's op (CPU and GPU
flash kernels keep q, k, v, the output and a log-sum-exp, never the s x s scores), which the
meta device would otherwise replace by the math path. A bare parameter count uses the formula
of Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer
models", eq. 1: 34sbh + 5as^2b bytes per layer in 16-bit) with flash attention (no s^2
term) and no dropout (no masks): 16 elements per token and width per layer, plus the logits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..strategies import ParamShapes, param_shapes
from ..torch_internals import flash_attention_cpu, storage_id
from .errors import PlanError
from .lora import LoraSpec, adapt


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A model as the planner sees it.

    name: a built-in model name, or a description.
    params: trainable parameters (Psi).
    tensor_numels: each trainable parameter's number of elements, in registration order
        (buckets are planned over them in reverse, as the strategies do).
    matrices: (rows, cols) of each 2-D parameter (PowerSGD compresses these).
    units: ZeRO-3's units with the default wrap (`plan_units`), the root first: the numels of
        the trainable parameters each owns.
    layers: transformer blocks (0 when unknown).
    width: the residual stream's width (0 when unknown).
    seq_len: tokens per sample.
    vocab: output classes per token (0 when unknown).
    flops_per_token: forward + backward FLOPs per token: 6 x the weights of linear layers
        (the head included) + 12 x layers x width x seq_len for attention (PaLM's count,
        Chowdhery et al. 2022, appendix B, as torchtitan reports MFU).
    activation_bytes: bytes kept for backward per sample ([Note: activations]), in the
        precision policy's compute dtype; 0 when the shape is unknown.
    largest_activation: bytes of the widest tensor one sample's backward works on (the
        gradient of the MLP's hidden layer or of the logits): the working set on top.
    transient_bytes: the most bytes per sample alive at once in a traced forward, loss and
        backward, parameters and gradients excepted ([Note: transient peak]): the activations
        still kept and backward's temporaries at that moment; 0 when not traced (the planner
        then counts activation_bytes + largest_activation).
    frozen_units: per ZeRO-3 unit (`units`' order, the root first), the elements of its
        parameters that take no gradient: held, never trained ([Note: planner LoRA]).
    """

    name: str
    params: int
    tensor_numels: tuple[int, ...]
    matrices: tuple[tuple[int, int], ...]
    units: tuple[tuple[int, ...], ...]
    layers: int
    width: int
    seq_len: int
    vocab: int
    flops_per_token: float
    activation_bytes: float
    largest_activation: float
    transient_bytes: float = 0.0
    frozen_units: tuple[int, ...] = ()

    @property
    def frozen(self) -> int:
        """Frozen parameters' elements (a LoRA base, [Note: planner LoRA] in lora.py)."""
        return sum(self.frozen_units)

    @property
    def param_shapes(self) -> ParamShapes:
        """What the policies' footprints read ([Note: footprint])."""
        return ParamShapes(self.tensor_numels, self.units)


class _FlashAttention(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to the flash op, which keeps no s x s scores
    ([Note: activations])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not kwargs.get("attn_mask"):
            q, k, v = args[:3]
            dropout, causal = kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False)
            op = flash_attention_cpu()
            return op(q, k, v, dropout, causal)[0]
        return func(*args, **kwargs)


def saved_bytes(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps for backward in `run(model)` (a meta
    forward and loss), parameters excepted."""
    params = {storage_id(p.untyped_storage()) for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage_id(storage) not in params:
            kept[storage_id(storage)] = storage.nbytes()
        return t

    with _FlashAttention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(model)
    return sum(kept.values())


def transient_bytes(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> int:
    """[Note: transient peak] The most bytes alive at once in `run(model)` (a meta forward and
    loss) and its backward, the model's parameters, buffers and gradients excepted: what a
    step adds on top of the model states at its peak. Traced as the dry run measures its peak
    ([Note: meta peak] in live_bytes.py), a parameter's gradient dropped once accumulated (the
    strategies move it into their own buffers, which the footprint counts; until then autograd's
    gradient is a temporary, in the engine as here); attention through the flash op ([Note:
    activations]). The peak is usually early in backward: the activations of every block
    minus the loss's and the head's, plus the block's backward temporaries (the gradients of
    the MLP's hidden layer), or, with a large vocabulary and long sequences, at the loss
    (the fp32 logits and their gradients)."""
    from .live_bytes import LiveBytes

    live = LiveBytes(resized_by_hand=False)  # no engine here: only operators resize
    states = [*model.parameters(), *model.buffers()]
    for t in states:
        live.label(t, "model states")
    params = [p for p in model.parameters() if p.requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(drop_grad) for p in params]
    try:
        with _FlashAttention(), live:
            live.measuring = True
            run(model).backward()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(b for tag, b in live.peak_terms().items() if tag != "model states")


def drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def lm_run(tokens: int, batch: int, vocab: int, autocast: torch.dtype | None):
    """A language model's forward and cross-entropy loss on meta token ids."""

    def run(model: nn.Module) -> torch.Tensor:
        x = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
        context = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        with context:
            logits = model(x)
        return F.cross_entropy(logits.reshape(-1, vocab).float(), x.reshape(-1))

    return run


def linear_flops(model: nn.Module) -> int:
    """Forward and backward FLOPs per token of every nn.Linear, shared weights once per use (a
    tied head costs its matrix product even though its parameter is the embedding's): 6 per
    weight trained, 4 per weight frozen (no weight gradient, [Note: planner LoRA])."""
    return sum(
        (6 if m.weight.requires_grad else 4) * m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear)
    )


def shape_of_module(
    model: nn.Module,
    *,
    name: str,
    seq_len: int = 0,
    layers: int = 0,
    width: int = 0,
    vocab: int = 0,
    activation_bytes: float = 0.0,
    largest_activation: float = 0.0,
) -> ModelShape:
    params = [p for p in model.parameters() if p.requires_grad]
    shapes = param_shapes(model)
    return ModelShape(
        name=name,
        params=sum(p.numel() for p in params),
        tensor_numels=tuple(p.numel() for p in params),
        matrices=tuple(tuple(p.shape) for p in params if p.dim() == 2),
        units=shapes.units,
        layers=layers,
        width=width,
        seq_len=seq_len,
        vocab=vocab,
        flops_per_token=linear_flops(model) + 12 * layers * width * seq_len,
        activation_bytes=activation_bytes,
        largest_activation=largest_activation,
        frozen_units=shapes.frozen_units,
    )


def widest(width: int, hidden: int, vocab: int, seq_len: int, itemsize: int) -> float:
    """Bytes per sample of the widest tensor backward works on ([Note: activations])."""
    return seq_len * max(hidden, vocab) * itemsize


@functools.lru_cache(maxsize=64)
def builtin_shape(
    name: str,
    seq_len: int | None,
    compute: torch.dtype,
    autocast: torch.dtype | None,
    tp: int = 1,
    lora: LoraSpec | None = None,
) -> ModelShape:
    """A model of dataparallel.models (or a Llama of llama.py), built and traced on meta; with
    `tp` > 1 the part one rank holds ([Note: planner tensor parallelism]); with `lora` its base
    frozen and adapters on the targets ([Note: planner LoRA]). Kept per argument (a frozen
    ModelShape): a dry run plans once per role, and the trace of llama-8b takes seconds."""
    from ..models import MODEL_CONFIGS, build_model
    from .llama import LLAMA_CONFIGS
    from .tensor_parallel import narrow

    if name in LLAMA_CONFIGS:
        return llama_shape(name, LLAMA_CONFIGS[name], seq_len, compute, autocast, tp, lora=lora)
    if name not in MODEL_CONFIGS or not hasattr(MODEL_CONFIGS[name], "n_layer"):
        gpts = [n for n, c in MODEL_CONFIGS.items() if hasattr(c, "n_layer")]
        known = ", ".join(sorted([*gpts, *LLAMA_CONFIGS]))
        raise PlanError("--model", f"unknown model {name!r}", f"choose one of {known}")
    config = MODEL_CONFIGS[name]
    seq_len = seq_len or config.block_size
    if seq_len > config.block_size:
        raise PlanError(
            "--seq-len",
            f"{seq_len} exceeds {name}'s block_size {config.block_size}",
            f"give at most {config.block_size}",
        )
    with torch.device("meta"):
        model = narrow(build_model(name).to(compute), tp, config.n_head)
        if lora is not None:
            adapt(model, lora, name)
    kept = saved_bytes(model, lm_run(seq_len, 1, config.vocab_size, autocast))
    itemsize = (autocast or compute).itemsize
    shape = shape_of_module(
        model,
        name=name,
        seq_len=seq_len,
        layers=config.n_layer,
        width=config.n_embd,
        vocab=config.vocab_size,
        activation_bytes=kept,
        largest_activation=widest(
            config.n_embd, 4 * config.n_embd // tp, config.vocab_size, seq_len, itemsize
        ),
    )
    return traced_peak(shape, model, autocast)


def llama_shape(
    name: str,
    config,
    seq_len: int | None,
    compute: torch.dtype,
    autocast: torch.dtype | None,
    tp: int = 1,
    *,
    lora: LoraSpec | None = None,
) -> ModelShape:
    """A Llama of llama.py with `config` (a `LlamaConfig`, a built-in one or any other),
    built and traced on meta; with `tp` > 1 the part one rank holds; with `lora` adapted."""
    from .llama import Llama
    from .tensor_parallel import narrow

    with torch.device("meta"):
        model = narrow(Llama(config).to(compute), tp, config.n_heads, config.n_kv_heads)
        if lora is not None:
            adapt(model, lora, name)
    shape = shape_of_module(
        model,
        name=name,
        seq_len=seq_len or config.seq_len,
        layers=config.n_layer,
        width=config.dim,
        vocab=config.vocab_size,
    )
    activations = llama_activations(shape, config, compute, autocast, tp)
    return traced_peak(activations, model, autocast)


def traced_peak(shape: ModelShape, model: nn.Module, autocast) -> ModelShape:
    """`shape` with its transient peak traced on `model` ([Note: transient peak])."""
    from dataclasses import replace

    run = lm_run(shape.seq_len, 1, shape.vocab, autocast)
    return replace(shape, transient_bytes=transient_bytes(model, run))


def llama_activations(shape: ModelShape, config, compute, autocast, tp: int = 1) -> ModelShape:
    """Llama's activations by formula ([Note: activations] with Llama's block: RMSNorm,
    grouped-query attention, SwiGLU): per token and layer 6h + 2kv + 4ffn elements, plus
    the logits (compute dtype) and their fp32 log-softmax. Under tensor parallelism the two
    norms' inputs and outputs (4h) stay whole and the rest is split `tp` ways."""
    from dataclasses import replace

    itemsize = (autocast or compute).itemsize
    kv = config.dim // config.n_heads * config.n_kv_heads
    split = (2 * config.dim + 2 * kv + 4 * config.ffn_dim) / tp
    per_token = config.n_layer * (4 * config.dim + split) * itemsize
    per_token += config.vocab_size * (itemsize + 4)
    return replace(
        shape,
        activation_bytes=per_token * shape.seq_len,
        largest_activation=widest(config.dim, config.ffn_dim, config.vocab_size, shape.seq_len, 4),
    )


def bare_shape(
    params: float, layers: int, width: int, seq_len: int, vocab: int, itemsize: int
) -> ModelShape:
    """A bare parameter count; with layers, width and seq_len, GPT-2-shaped activations by
    Korthikanti et al.'s count ([Note: activations])."""
    params = int(params)
    per_sample = 0.0
    if layers and width and seq_len:
        per_sample = seq_len * (16 * layers * width * itemsize + vocab * (itemsize + 4))
    # Without the layout, one matrix per layer: buckets and units are what the sizes give.
    numels = (params,) if not layers else (params // layers,) * layers
    return ModelShape(
        name=f"{params:.3g} parameters",
        params=params,
        tensor_numels=numels,
        matrices=(),
        units=tuple((n,) for n in numels),  # the first layer stands for the root
        layers=layers,
        width=width,
        seq_len=seq_len,
        vocab=vocab,
        flops_per_token=6 * params + 12 * layers * width * seq_len,
        activation_bytes=per_sample,
        largest_activation=widest(width, 4 * width, vocab, seq_len, itemsize) if layers else 0,
    )

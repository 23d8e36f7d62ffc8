"""What tensor parallelism changes in a plan: the part of the model a rank holds, and the
activation all-reduces its blocks add.

[Note: planner tensor parallelism] With --tp T (docs/core.md, "Hybrid parallelism") a rank of
a T-way split holds its local part of each block, as `dataparallel train --tp` splits the
reference GPT: q, k, v (Llama: wq, wk, wv) and the MLP's first linear(s) by output rows
(ColwiseParallel), the attention's output projection and the MLP's second linear by input
columns (RowwiseParallel, its bias whole), T ways; embeddings, norms and the head whole. So the
planner plans the *local* model: `narrow` builds it on the meta device with the narrower
linears, and everything downstream (the strategies' footprints over the dp ranks, the traced
activations, the FLOPs) is that of the local model, exactly as a run holds it. Without
sequence parallelism each block then all-reduces its attention's and its MLP's outputs in
forward, and the gradients of their inputs in backward: 2 all-reduces of micro-batch x
seq_len x width in the compute dtype per block per direction, over the T consecutive ranks
of the "tp" group. They sit between the block's matrix products, so nothing hides them
(window "none").
"""

from __future__ import annotations

from torch import nn

from .collectives import Collective, span
from .errors import PlanError

# per model family: module names split by output rows, and by input columns
COLUMNS = {"gpt": ("attn.q", "attn.k", "attn.v", "mlp.0"), "llama": ("wq", "wk", "wv", "w1", "w3")}
ROWS = {"gpt": ("attn.proj", "mlp.2"), "llama": ("wo", "w2")}


def _family(model: nn.Module) -> str:
    blocks = getattr(model, "blocks", None) or getattr(model, "layers", None)
    if blocks is None or not len(blocks):
        raise PlanError(
            "--tp",
            f"{type(model).__name__} has no tensor-parallel plan",
            "plan a reference GPT or a Llama, or drop --tp",
        )
    return "gpt" if hasattr(model, "blocks") else "llama"


def narrow(model: nn.Module, tp: int, heads: int, kv_heads: int | None = None) -> nn.Module:
    """`model` (on the meta device) as one rank of a `tp`-way split holds it: its split
    linears replaced by narrower ones ([Note: planner tensor parallelism]); in place."""
    if tp == 1:
        return model
    for what, count in (("heads", heads), ("key/value heads", kv_heads or heads)):
        if count % tp:
            raise PlanError(
                "--tp",
                f"{tp} does not divide the model's {count} {what}",
                f"give a divisor of {count}",
            )
    family = _family(model)
    blocks = model.blocks if family == "gpt" else model.layers
    for block in blocks:
        for name in COLUMNS[family] + ROWS[family]:
            parent, _, leaf = name.rpartition(".")
            owner = block.get_submodule(parent) if parent else block
            old = getattr(owner, leaf) if not leaf.isdigit() else owner[int(leaf)]
            rows = name in ROWS[family]
            din = old.in_features // tp if rows else old.in_features
            dout = old.out_features if rows else old.out_features // tp
            new = nn.Linear(
                din, dout, bias=old.bias is not None, device="meta", dtype=old.weight.dtype
            )
            if leaf.isdigit():
                owner[int(leaf)] = new
            else:
                setattr(owner, leaf, new)
    return model


def activation_all_reduces(
    tp: int,
    layers: int,
    width: int,
    tokens: int,
    itemsize: int,
    micro_steps: int,
    ranks: int,
    ranks_per_node: int,
) -> list[Collective]:
    """The tensor-parallel collectives of one step ([Note: planner tensor parallelism]):
    `tokens` per micro-batch per rank, `micro_steps` micro-batches."""
    if tp == 1:
        return []
    group = span(tp, 1, ranks, ranks_per_node)
    size = 2 * layers * micro_steps * tokens * width * itemsize
    calls = 2 * layers * micro_steps
    return [
        Collective(
            what=f"activations ({direction})",
            kind="all_reduce",
            buffer_bytes=size,
            group=group,
            calls=calls,
            window="none",
        )
        for direction in ("forward", "backward")
    ]

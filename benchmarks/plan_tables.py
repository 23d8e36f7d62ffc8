"""The cluster tables of docs/plan.md: Llama-shaped 1B, 8B and 70B on 8 to 8,192 GPUs.

    python benchmarks/plan_tables.py > /tmp/tables.md

bf16 parameters with fp32 masters and AdamW, 8,192-token sequences, one sequence per GPU per
step, activation checkpointing for 8B and 70B; every number is the planner's (no run). DiLoCo
twice: the paper's (fp32 outer gradients, the whole model at once) and the recipe that
`dataparallel train --diloco 100` runs (4 fragments in int4, each behind one inner step).
"""

from __future__ import annotations

import dataparallel as dp

GPUS = (8, 64, 512, 8192)
HARDWARE = ("h100-node", "ethernet-100g", "ethernet-10g")
PAPER = {"fragments": 1, "overlap": 0, "outer_compress": "fp32"}  # the paper's DiLoCo
COLUMNS = (  # (strategy, label, compressor, other plan arguments)
    ("ddp", "ddp", "none", {}),
    ("zero1", "zero1 S=N", "none", {}),
    ("zero2", "zero2 S=N", "none", {}),
    ("zero3", "zero3 S=N", "none", {}),
    ("zero3", "zero3 S=8", "none", {}),
    ("zero3", "zero3 S=8 +int8", "int8", {}),
    ("diloco", "diloco paper S=8 H=100", "none", PAPER),
    ("diloco", "diloco recipe S=8 H=100", "none", {}),  # `--diloco 100`: streamed, int4
)


def cell(model: str, n: int, hardware: str, strategy: str, label: str, compress: str,
         extra: dict) -> str:  # fmt: skip
    shard = 8 if "S=8" in label else n
    if strategy == "diloco" and n == 8:
        return "-"
    rows = dp.plan(model, ranks=n, hardware=hardware, precision="bf16-params",
                   strategies=[strategy], shard_sizes=[shard], compress=compress,
                   activation_checkpointing=model != "llama-1b", **extra).rows  # fmt: skip
    if strategy == "diloco":
        rows = [r for r in rows if r.candidate.shard_size == 8]
    if compress != "none":
        rows = [r for r in rows if r.candidate.compress == compress] or rows
    r = rows[0]
    if not r.fits:
        return f"OOM ({r.peak_bytes / 1e9:.0f})"
    return f"{r.tokens_per_s:,.0f} ({r.peak_bytes / 1e9:.0f})"


def main() -> None:
    for model in ("llama-1b", "llama-8b", "llama-70b"):
        print(f"\n**{model}** ({dp.plan(model, ranks=8).model.params / 1e9:.2f}B): "
              "tokens/s per GPU (peak GB per GPU)\n")  # fmt: skip
        print("| GPUs | network | " + " | ".join(c[1] for c in COLUMNS) + " |")
        print("|--:|---|" + "--:|" * len(COLUMNS))
        for n in GPUS:
            for hw in HARDWARE:
                if n == 8 and hw != "h100-node":
                    continue  # one node: the network between nodes is never used
                cells = [cell(model, n, hw, *c) for c in COLUMNS]
                print(f"| {n:,} | {hw} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

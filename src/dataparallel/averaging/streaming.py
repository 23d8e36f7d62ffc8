"""Streaming DiLoCo's settings: their checks, the fragments' layout, and the measured recipe.

Pure functions and a frozen policy, no process group: `DiLoCo` (diloco.py) takes the
settings; `dp.Recipe` and `dataparallel train --diloco H` fill the ones not given from
`short_run_recipe`.

[Note: the DiLoCo recipe] What `--diloco H` does unless told otherwise, found by measurement
on gpt-tiny, 2 ranks, 300 steps of AdamW, validation loss against DDP's at the same tokens
(docs/compression.md, "Measured on a short run", has each ingredient's row and the command):
- fragments: 4 synchronised in turn (2, or 1, where 4 does not divide H or leaves fewer than
  2 steps between fragments), each all-reduce behind 1 inner step (`overlap`), mixed half and
  half with the local values: +8.4% -> +4.6% of DDP's loss at H = 20;
- outer gradients in 4 bits with error feedback: 8x fewer bytes for no loss (+4.1%);
- the run ends on the replicas' average (`DiLoCo.finish`, called by the trainer): +3.8%, at
  150x fewer bytes on the wire than DDP;
- a synchronous warm-up as long as the learning rate's (30 steps there; the CLI takes its
  --warmup-steps), one fragment averaged after every step, in turn, in the same 4 bits: +2.8%
  at 108x fewer bytes; on a longer run, a tenth of the run if that is longer (gpt-small,
  2,000 steps: 200 warm-up steps +3.1% of DDP's loss at 114x fewer bytes, against 30 steps
  +4.5% at 150x; on the 300-step run 40 steps did no better than 30). Averaging the whole model each step gave +1.8% at 54x (a 300-step run
  cannot amortise whole models); shorter warm-ups did not pay (8 steps +4.4%, 15 +3.6%).
Left out, measured: an outer momentum of 0.5 (+4.6%), an outer lr of 1.0 (+3.7%, within
noise of 0.7), mix 0 (+9.3%) or 0.75 (+4.5%), H = 10 (+3.6% at twice the bytes).
The exactness anchor stays reachable by explicit settings: fragments 1, overlap 0, warm-up 0,
fp32 outer gradients is DiLoCo as written in the paper (tests/dist/test_streaming.py).
"""

from __future__ import annotations

from dataclasses import dataclass

OUTER_FORMATS = (None, "bf16", "int8", "fp8", "int4")
OUTER_COMPRESS = ("recipe", "", "fp32", "bf16", "int8", "fp8", "int4")  # as the CLI spells them
RECIPE = -1  # a streaming setting left to the recipe ([Note: the DiLoCo recipe])


@dataclass(frozen=True, kw_only=True)
class Streaming:
    """How DiLoCo streams its outer steps ([Note: streaming DiLoCo] in diloco.py).

    fragments: F, the parts of the model synchronised in turn, each every H steps, staggered
        by H / F (F divides H); 1 is DiLoCo itself.
    overlap: tau, inner steps a fragment's outer all-reduce runs behind before it is applied
        (below H / F); 0: at once.
    compress: outer gradients on the wire: None (fp32), "bf16", "int8", "fp8" or "int4".
    warmup: the first steps average the replicas after every step (sent as `compress` says).
    """

    fragments: int = 1
    overlap: int = 0
    compress: str | None = None
    warmup: int = 0


def short_run_recipe(
    every: int,
    fragments: int = RECIPE,
    overlap: int = RECIPE,
    compress: str = "recipe",
    warmup: int = RECIPE,
    lr_warmup: int = 30,
    run_steps: int = 0,
) -> Streaming:
    """The recipe's settings for DiLoCo every `every` steps ([Note: the DiLoCo recipe]), each
    one given kept as it is: the integers unless RECIPE; `compress` as the CLI spells it:
    "recipe" for the recipe's, "" or "fp32" for none, else the format. The recipe's warm-up
    is the longer of `lr_warmup`, the learning rate's warm-up steps, and a tenth of
    `run_steps`, the run's steps (0: not known)."""
    if fragments == RECIPE:
        fragments = next(f for f in (4, 2, 1) if every % f == 0 and every // f >= min(2, every))
    if overlap == RECIPE:
        overlap = 1 if isinstance(fragments, int) and 0 < fragments <= every // 2 else 0
    return Streaming(
        fragments=fragments,
        overlap=overlap,
        compress={"recipe": "int4", "": None, "fp32": None}.get(compress, compress),
        warmup=max(lr_warmup, run_steps // 10) if warmup == RECIPE else warmup,
    )


def check_streaming(every: int, fragments: int, overlap: int, mix: float) -> None:
    """The streaming fields, against each other (ValueError naming the field)."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"diloco: fragments={fragments!r} must be an integer >= 1")
    if isinstance(every, int) and every % fragments:
        raise ValueError(
            f"diloco: fragments={fragments} must divide every={every} (each fragment is "
            "synchronised every `every` steps, staggered by every / fragments)"
        )
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"diloco: overlap={overlap!r} must be an integer >= 0")
    if isinstance(every, int) and overlap and overlap >= every // fragments:
        raise ValueError(
            f"diloco: overlap={overlap} must be below every / fragments = "
            f"{every // fragments} (one outer reduction in flight at a time)"
        )
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"diloco: mix={mix} must be in [0, 1]")


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Positions of `sizes` in `fragments` consecutive runs of about equal total size (each
    tensor whole, in order; a fragment may be empty when there are fewer tensors)."""
    total, parts, acc = sum(sizes), [[] for _ in range(fragments)], 0
    for i, size in enumerate(sizes):
        # the fragment in whose equal share of the total this tensor's middle falls
        fragment = min(fragments - 1, int((acc + size / 2) * fragments / max(total, 1)))
        parts[fragment].append(i)
        acc += size
    return parts

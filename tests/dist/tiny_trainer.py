"""The trainer on a tiny in-memory corpus: its state for a strategy and a global batch, and the
samples it trained on (test_resharding.py, test_uneven_batches.py, test_blame.py)."""

from __future__ import annotations

import torch

TEXT = (b"def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 40)[:1500]
GLOBAL_BATCH, ACCUM = 8, 2  # the uneven split of test_uneven_batches.py (3 ranks: 3, 3, 2)


def trainer_state(
    world, strategy: str, run_dir: str = "", global_batch: int = GLOBAL_BATCH, accum=ACCUM
):
    """The trainer's state (`setup`) on TEXT under `strategy`: a global batch of `global_batch`
    windows in `accum` micro-batches, over this world's ranks."""
    from dataparallel.data.corpus import Corpus
    from dataparallel.train.config import RunConfig
    from dataparallel.train.trainer import setup

    config = RunConfig().replace(
        data={"block_size": 16, "eval_windows": 4, "val_fraction": 0.2},
        train={
            "steps": 10,
            "global_batch": global_batch,
            "batch": -(-global_batch // (accum * world.world_size)),
            "accum": accum,
            "seed": 3,
        },
        optim={"warmup_steps": 0},
        launch={"nproc": world.world_size, "strategy": strategy, "out": run_dir},
    )
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    corpus = Corpus(tokens=tokens, num_files=1, sha256="test", source="test")
    return setup(config, world, corpus)


def trained_samples(world, state, run_dir: str, steps: int, resume: bool) -> list[int]:
    """`steps` steps of the trainer's `state` (after resuming run_dir when `resume`), a
    checkpoint at the end; every sample index any rank trained on, in stream order (shares
    may differ by one: [Note: uneven batches] in trainer.py)."""
    from dataparallel.train.checkpointing import Checkpointer, restore
    from dataparallel.train.trainer import train_step

    if resume:
        restore(state, run_dir)
    taken = []
    take = state.ledger.samples.take_share

    def recording(global_batch, rank, world_size):
        out = take(global_batch, rank, world_size)
        taken.append(out)
        return out

    state.ledger.samples.take_share = recording
    for _ in range(steps):
        train_step(state)
    Checkpointer(run_dir, state, "sync").save(state)
    everyone = [None] * world.world_size
    torch.distributed.all_gather_object(everyone, taken)
    # Rank r took positions r, r + W, r + 2W, ... of each step.
    return [
        part[k]
        for step in zip(*everyone, strict=True)
        for k in range(len(step[0]))
        for part in step
        if k < len(part)
    ]

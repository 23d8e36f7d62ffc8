"""A checkpoint resumes a run where it stopped, through the ledger or the layout before it (a
world of one: the checkpoint's collectives); the ledger's pure logic is tests/unit/test_ledger.py."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

import dataparallel as dp
from dataparallel.data.corpus import Corpus
from dataparallel.train.checkpointing import Checkpointer, restore
from dataparallel.train.config import RunConfig
from dataparallel.train.trainer import setup, train_step

TEXT = (b"def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 40)[:1500]


def _state(world):
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    corpus = Corpus(tokens=tokens, num_files=1, sha256="test", source="test")
    config = RunConfig().replace(
        data={"block_size": 16, "eval_windows": 5, "val_fraction": 0.2},
        train={"steps": 6, "seed": 3, "batch": 4},
        optim={"warmup_steps": 0},
        launch={"nproc": 1},
    )
    return setup(config, world, corpus)


def _as_written_before_the_ledger(checkpoint) -> None:
    """Rewrite a checkpoint's train_state.json in the layout of the commit before the ledger
    (step, data position and skipped steps at the top level), its manifest entry with it."""
    path = checkpoint / "train_state.json"
    plain = json.loads(path.read_text())
    ledger = plain.pop("ledger")
    plain.update(samples=ledger["samples"], skipped_steps=ledger["skipped_steps"])
    path.write_text(json.dumps(plain, indent=1))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = path.read_bytes()
    manifest[path.name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1))


@pytest.mark.parametrize("layout", ["ledger", "before the ledger"])
def test_a_checkpoint_resumes_the_run_where_it_stopped(layout, tmp_path):
    """Two steps, a checkpoint, two more: the resumed run's two are the same losses; its ledger
    is the saved one (consecutive skips from a checkpoint before the ledger: 0)."""
    world = dp.init()
    try:
        state = _state(world)
        [train_step(state) for _ in range(2)]
        state.ledger.skipped_steps, state.ledger.consecutive_skips = 1, 2
        Checkpointer(tmp_path, state, "sync").save(state)
        whole = [train_step(state).loss for _ in range(2)]
        checkpoint = tmp_path / "checkpoint" / "step-000002"
        if layout != "ledger":
            _as_written_before_the_ledger(checkpoint)
        assert ("ledger" in json.loads((checkpoint / "train_state.json").read_text())) == (
            layout == "ledger"
        )
        resumed = _state(world)
        restore(resumed, tmp_path)
        ledger = resumed.ledger
        in_a_row = 2 if layout == "ledger" else 0
        assert (ledger.step, ledger.skipped_steps, ledger.consecutive_skips) == (2, 1, in_a_row)
        assert ledger.samples.consumed == 2 * 4
        assert [train_step(resumed).loss for _ in range(2)] == whole
    finally:
        dp.destroy()

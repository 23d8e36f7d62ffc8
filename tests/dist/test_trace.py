"""A traced training step in a world of one (a real process group of one rank); the tracer's
pure logic is tests/unit/test_trace.py."""

import torch

import dataparallel as dp
from dataparallel.data.corpus import Corpus
from dataparallel.train.config import RunConfig
from dataparallel.train.trace_report import step_breakdown
from dataparallel.train.tracing import chrome_trace
from dataparallel.train.trainer import setup, train_step


def test_the_phases_of_a_traced_step_cover_its_wall_time():
    text = (b"def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 40)[:1500]
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    corpus = Corpus(tokens=tokens, num_files=1, sha256="test", source="test")
    config = RunConfig().replace(
        data={"block_size": 16, "val_fraction": 0.2},
        train={"steps": 4, "batch": 4, "accum": 2},
        launch={"nproc": 1},
    )
    world = dp.init()
    try:
        state = setup(config, world, corpus)
        train_step(state)  # warm-up, untraced
        state.tracer.enabled = True
        train_step(state)
        train_step(state)
        state.tracer.enabled = False
        events = [e for e in chrome_trace(state.tracer, 0, (2, 3))["traceEvents"] if e["ph"] == "X"]
    finally:
        dp.destroy()
    rows = step_breakdown(events)
    assert [r["step"] for r in rows] == [2, 3]
    for row in rows:
        assert 0.9 <= row["coverage"] <= 1.0, row  # a busy machine may pause between spans
    names = [e["name"] for e in events if e["cat"] == "compute"]
    assert names.count("forward") == names.count("backward") == 4  # 2 steps x accum 2
    assert names.count("optimizer") == names.count("data") == names.count("loss") == 2

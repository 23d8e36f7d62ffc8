"""The job's step memory, measured: run by tests/e2e/test_train_activation_checkpointing.py.

    python activation_peak.py MODEL DATA on|off

Builds the run as `dataparallel train` does (`setup`: the model, --activation-checkpointing, the
strategy, the optimizer) in a world of one, ZeRO-3, and prints as JSON the peak of the CPU
allocator's running total (`torch.profiler` with `profile_memory`: allocated minus freed
bytes) above the start of the second step: the activations the step keeps plus its transient
gradients and logits.
"""

from __future__ import annotations

import json
import sys

from torch.profiler import ProfilerActivity, profile

import dataparallel as dp
from dataparallel.train.config import RunConfig
from dataparallel.train.trainer import setup, train_step


def main() -> None:
    model, data, flag = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
    config = RunConfig().replace(
        model={"name": model},
        data={"paths": (data,), "block_size": 64, "val_fraction": 0.1},
        train={"batch": 16, "steps": 3, "activation_checkpointing": flag},
        launch={"strategy": "zero3"},
    )
    world = dp.init()
    state = setup(config, world)
    train_step(state)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(state)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    print(json.dumps({"peak": peak}))
    dp.destroy()


if __name__ == "__main__":
    main()

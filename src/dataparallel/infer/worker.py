"""One worker of `dataparallel generate` or `eval`: joins the world, loads the model, does its
share and (rank 0) writes the result.

The command (command.py) checks the input and starts the workers with the launcher that
`dataparallel train` uses too (launch/workers.py), passing the job in DATAPARALLEL_INFER; with one worker
on one machine it runs `run_job` in its own process instead.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import dataparallel as dp

from ..launch.config import ConfigError
from ..launch.workers import freeze_imports
from .decoding import Sampling
from .evaluate import EvalJob, evaluate
from .generate import GenerateJob, generate
from .model_loading import ModelSource, load_model

ENV_JOB = "DATAPARALLEL_INFER"


def encode_job(command: str, source: ModelSource, strategy: str, job) -> str:
    fields = asdict(job)
    return json.dumps(
        {
            "command": command,
            "source": {"kind": source.kind, "path": str(source.path)},
            "strategy": strategy,
            "job": fields,
        }
    )


def decode_job(text: str) -> tuple[str, ModelSource, str, GenerateJob | EvalJob]:
    data = json.loads(text)
    fields = data["job"]
    if data["command"] == "generate":
        job = GenerateJob(**{**fields, "sampling": Sampling(**fields["sampling"])})
    else:
        job = EvalJob(**{**fields, "paths": tuple(fields["paths"])})
    source = ModelSource(data["source"]["kind"], Path(data["source"]["path"]))
    return data["command"], source, data["strategy"], job


def run_job(command: str, source: ModelSource, strategy: str, job) -> None:
    """Do this rank's part of `job`; rank 0 prints one line of results (and writes them)."""
    world = dp.init()
    loaded = None
    try:
        started = time.perf_counter()
        loaded = load_model(source, sharded=strategy == "zero3")
        loaded_at = time.perf_counter()
        if command == "generate":
            texts = generate(world, loaded, job)
            if world.is_main:
                load, work = loaded_at - started, time.perf_counter() - loaded_at
                print(
                    f"dataparallel generate: {len(texts)} completions in {job.out} "
                    f"({_workers(world)}; load {load:.2f} s, generate {work:.2f} s)",
                    flush=True,
                )
        else:
            result = evaluate(world, loaded, job)
            if world.is_main:
                print(
                    f"dataparallel eval: loss {result.loss:.6f} perplexity {result.perplexity:.4f} "
                    f"over {result.tokens} tokens in {result.windows} windows "
                    f"({_workers(world)})",
                    flush=True,
                )
                if job.out:
                    with open(job.out, "w") as handle:
                        json.dump(asdict(result), handle, indent=2)
    except ConfigError as error:  # found by every rank together (generate.check_context)
        if world.is_main:
            print(f"dataparallel {command}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        loaded = None  # [Note: teardown] in train/worker.py: the model before the group
        gc.collect()
        dp.destroy()


def _workers(world: dp.World) -> str:
    return "1 worker" if world.world_size == 1 else f"{world.world_size} workers"


def main() -> int:
    """Entry point of a worker started by the launcher (`python -m dataparallel.infer.worker`)."""
    freeze_imports()  # [Note: frozen imports] in launch/workers.py
    run_job(*decode_job(os.environ[ENV_JOB]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`dataparallel generate` and `dataparallel eval`: flags, checks, and starting the workers.

Bad input is one line, `dataparallel generate: error: <field>: <problem>; <fix>`, exit status
2, before any worker starts and before anything is written. One worker on one machine runs in
this process; more are started by the shared launcher (launch/workers.py).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..launch.command import add_command, refused
from ..launch.config import ConfigError
from ..launch.flags import add_launcher_flags, launcher_config

STRATEGIES = ("ddp", "zero3")  # as infer/worker.py takes them
# Generation and scoring start over on a restart: none unless asked for.
DEFAULTS = {"max_restarts": 0}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run",
        metavar="RUN_OR_DIR",
        help="a run directory of dataparallel train (model.safetensors, or an hf/ export) or a "
        "save_pretrained directory (config.json)",
    )
    parser.add_argument(
        "--strategy",
        default="ddp",
        help="ddp: each worker holds the whole model; zero3: the model is sharded across the "
        "workers, every forward gathers it unit by unit (default: ddp)",
    )
    parser.add_argument("--batch", type=int, default=8, help="per worker per forward (default 8)")


def add_generate_parser(commands) -> None:
    parser = add_command(commands, "generate", cmd_generate)
    _common(parser)
    parser.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="the prompts")
    parser.add_argument("--out", required=True, metavar="FILE.jsonl", help="the completions")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (64)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling"
    )
    parser.add_argument(
        "--top-k", type=int, default=40, help="sample among the k likeliest (40; 0: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (0)")
    add_launcher_flags(parser, DEFAULTS)


def add_eval_parser(commands) -> None:
    parser = add_command(commands, "eval", cmd_eval)
    _common(parser)
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        metavar="PATH",
        help="text, JSONL, Parquet or token files, or folders (as train --data reads them)",
    )
    parser.add_argument(
        "--block", type=int, default=0, help="tokens per window (0: the model's context, <= 1024)"
    )
    parser.add_argument("--out", default="", metavar="FILE.json", help="also write the result")
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the token cache goes, as for train --cache-dir (over $DATAPARALLEL_CACHE_DIR)",
    )
    add_launcher_flags(parser, DEFAULTS)


def check_prompts(path: str) -> int:
    """How many prompts the JSONL file holds; ConfigError at the first line that is not one."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("--prompts", f"{path} is not a file", "give a JSONL file of prompts")
    count = 0
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(
                    "--prompts", f"line {number} of {path} is not JSON", "write one object a line"
                ) from None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(
                    "--prompts",
                    f'line {number} of {path} has no "prompt" text',
                    'give each line a non-empty "prompt" string, e.g. {"prompt": "def "}',
                )
            count += 1
    if not count:
        raise ConfigError("--prompts", f"{path} holds no prompt", 'add lines {"prompt": "..."}')
    return count


def _check_out(path: str, field: str = "--out") -> None:
    out = Path(path)
    if out.is_dir():
        raise ConfigError(field, f"{path} is a directory", "give a file name")
    if not out.parent.is_dir():
        raise ConfigError(field, f"{out.parent} does not exist", "create it, or write elsewhere")


def _at_least(field: str, value, minimum) -> None:
    if not (isinstance(value, int) or math.isfinite(value)) or value < minimum:
        raise ConfigError(field, f"{value} is below {minimum}", f"use {minimum} or more")


def generate_job(args: argparse.Namespace):
    from .decoding import Sampling
    from .generate import GenerateJob

    check_prompts(args.prompts)
    _check_out(args.out)
    if Path(args.out).resolve() == Path(args.prompts).resolve():
        raise ConfigError("--out", "is the prompts file", "write the completions elsewhere")
    for field, value, minimum in [
        ("--tokens", args.tokens, 1),
        ("--batch", args.batch, 1),
        ("--temperature", args.temperature, 0),
        ("--top-k", args.top_k, 0),
    ]:
        _at_least(field, value, minimum)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    return GenerateJob(
        prompts=args.prompts, out=args.out, tokens=args.tokens, batch=args.batch, sampling=sampling
    )


def eval_job(args: argparse.Namespace):
    from ..data.formats import DataError
    from ..data.loading import data_files
    from .evaluate import EvalJob

    try:  # the files and their formats; their records are read by the workers
        data_files(args.data)
    except DataError as error:  # its own fix (a cache inside the data: --cache-dir)
        raise ConfigError("--data", error.problem, error.fix) from None
    except (OSError, ValueError) as error:
        raise ConfigError(
            "--data", str(error), "give text, JSONL, Parquet or token files, or folders"
        ) from None
    _at_least("--block", args.block, 0)
    _at_least("--batch", args.batch, 1)
    if args.out:
        _check_out(args.out)
    return EvalJob(paths=tuple(args.data), block=args.block, batch=args.batch, out=args.out)


def _run(command: str, args: argparse.Namespace) -> int:
    from ..launch.forked import launcher_threads
    from .model_loading import check_model, find_model

    if args.own_process:  # its workers are forked from it: [Note: forked workers]
        launcher_threads()  # (one worker runs here, with its own threads: `start`)

    try:
        launch = launcher_config(args, DEFAULTS)
        if args.strategy not in STRATEGIES:
            raise ConfigError(
                "--strategy",
                f"unknown value {args.strategy!r}",
                f"choose {' or '.join(STRATEGIES)}",
            )
        source = find_model(args.run)
        check_model(source)
        job = generate_job(args) if command == "generate" else eval_job(args)
    except ConfigError as error:
        return refused(command, error)
    return start(command, source, args.strategy, job, launch, fork=args.own_process)


def start(command: str, source, strategy: str, job, launch, *, fork: bool = False) -> int:
    """Run the job: in this process for one worker on one machine, else under the launcher
    (`fork`: its workers forked from this process, a command's own: [Note: forked workers] in
    launch/forked.py)."""
    from ..launch.workers import fair_threads, start_workers
    from .worker import ENV_JOB, encode_job, run_job

    if launch.nproc == 1 and launch.nnodes == 1:
        import torch

        torch.set_num_threads(launch.threads or fair_threads(1))
        try:
            run_job(command, source, strategy, job)
        except SystemExit as exit:  # run_job has printed the error
            return exit.code
        return 0
    env = {ENV_JOB: encode_job(command, source, strategy, job)}
    return start_workers(launch, ["--module", "dataparallel.infer.worker"], env, fork=fork)


def cmd_generate(args: argparse.Namespace) -> int:
    """complete a JSONL file of prompts with data-parallel workers

    Complete every prompt of a JSONL file (a 'prompt' field a line), split across the workers;
    write one line per prompt, in input order, with its 'completion'.
    """
    return _run("generate", args)


def cmd_eval(args: argparse.Namespace) -> int:
    """the exact perplexity of a dataset, with data-parallel workers

    Mean cross-entropy per target token of the data, and its exp (the perplexity), the same for
    any number of workers.
    """
    from ..data.cache import use_cache_dir

    use_cache_dir(args.cache_dir)
    return _run("eval", args)

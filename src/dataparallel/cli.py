"""The `dataparallel` command: `train` a model with several workers, `sample` from the result.

    dataparallel train                                  # 2 workers, built-in corpus, gpt-tiny
    dataparallel train --nproc 4 --model gpt-small --steps 1000 --out runs/small
    dataparallel train --config examples/train.toml --lr 1e-3
    dataparallel train --resume runs/small --steps 2000
    dataparallel train --recovery live --max-replicas 4 --out runs/live   # survives a lost worker
    dataparallel join runs/live                        # one more replica for that run
    dataparallel leave runs/live --replica 1           # one fewer
    dataparallel sample runs/small --prompt "def "
    dataparallel export runs/small/checkpoint/step-000200 --out weights/   # any checkpoint
    dataparallel launch --nproc 2 my_train.py --lr 1e-4    # your script, under our launcher
    dataparallel generate runs/small --prompts p.jsonl --out c.jsonl --nproc 2   # completions
    dataparallel eval runs/small --data valid/ --nproc 2   # the exact perplexity of a dataset
    dataparallel plan --model llama-8b --ranks 64 --precision bf16-params   # before launch
    torchrun --nproc-per-node 2 -m dataparallel.cli train --steps 50   # under torchrun itself
    srun --ntasks-per-node=1 dataparallel train --nproc 4 ...   # Slurm, Kubeflow: docs/clusters.md
    dataparallel cluster slurm --nodes 2 --nproc 4 --steps 1000 > job.sbatch   # a job file

Every `train` flag is a field of the config (train/config.py; `--print-config` shows them all
with their documentation); `launch`, `generate` and `eval` take its launcher flags (--nproc,
--nnodes, --max-restarts, --collective-timeout...; docs/workloads.md). Bad input is reported on one line, `dataparallel train: error:
<field>: <problem>; <fix>`, with exit status 2, before anything is started or written.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import fields
from pathlib import Path

from .infer.command import add_eval_parser, add_generate_parser
from .launch.cluster_command import add_cluster_parser
from .launch.command import add_command, refused
from .launch.environments import detect
from .launch.flags import add_launcher_flags, launcher_config
from .launch.forked import launcher_threads
from .launch.topology import Topology
from .launch.workers import freeze_imports
from .plan.command import add_plan_parser
from .train.config import (
    SECTIONS,
    ConfigError,
    RunConfig,
    field_docs,
    flag_name,
)
from .train.config_toml import load_toml, to_toml
from .train.export import add_export_parser
from .train.live.elastic import add_join_parser, add_leave_parser

TYPES = {"int": int, "float": float, "str": str}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with the same exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def add_train_parser(commands) -> None:
    parser = add_command(commands, "train", cmd_train)
    parser.add_argument("--config", metavar="FILE.toml", help="a TOML config file")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint (or give "
        "RUN_DIR/checkpoint/step-N for that one); --nproc and --strategy may change. "
        "auto: the same command started again (after a preemption) continues its --out from "
        "the latest complete checkpoint there, or starts the run when there is none",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as TOML and exit"
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the token cache goes, over $DATAPARALLEL_CACHE_DIR (default: .dpcache beside "
        "the data; for a read-only data folder ~/.cache/dataparallel/tokens). Not in the run's "
        "config: the place is the machine's (docs/workloads.md, 'The token cache')",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        docs = field_docs(cls)
        for f in fields(cls):
            if f.type == "bool":  # --check-collectives / --no-check-collectives
                extra = {"action": argparse.BooleanOptionalAction}
            elif f.type.startswith("tuple"):
                extra = {"nargs": "+", "metavar": {"report_to": "NAME"}.get(f.name, "PATH")}
            else:
                metavar = {"name": "MODEL"}.get(f.name, f.name.upper())
                extra = {"type": TYPES[f.type], "metavar": metavar}
            group.add_argument(
                flag_name(section, f.name),
                dest=f"{section}.{f.name}",
                default=None,
                help=docs[f.name].replace("%", "%%"),
                **extra,
            )


def add_launch_parser(commands) -> None:
    parser = add_command(commands, "launch", cmd_launch)
    add_launcher_flags(parser, LAUNCH_DEFAULTS)
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")


# A user's script does not resume by itself unless written to: restarts are asked for.
LAUNCH_DEFAULTS = {"max_restarts": 0}


def cmd_launch(args: argparse.Namespace) -> int:
    """run your training script with data-parallel workers

    Run SCRIPT in each worker, as torchrun would, with dataparallel's thread defaults,
    restarts, watchdog settings (read by dp.init()) and per-attempt store.
    """
    from .launch.workers import launch_script

    try:
        launch = launcher_config(args, LAUNCH_DEFAULTS)
        script = Path(args.script)
        if not script.is_file():
            problem = "is a directory" if script.is_dir() else "does not exist"
            raise ConfigError("script", f"{args.script} {problem}", "give a Python script")
    except ConfigError as error:
        return refused("launch", error)
    return launch_script(launch, str(script), args.script_args)


def add_sample_parser(commands) -> None:
    parser = add_command(commands, "sample", cmd_sample)
    parser.add_argument(
        "run",
        metavar="RUN_OR_DIR",
        help="a run directory (model.safetensors, or an hf/ export), a .safetensors file, or a "
        "save_pretrained directory",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: a new line)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens (bytes) to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dataparallel", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    add_train_parser(commands)
    add_launch_parser(commands)
    add_generate_parser(commands)
    add_eval_parser(commands)
    add_sample_parser(commands)
    add_export_parser(commands)
    add_plan_parser(commands)
    add_join_parser(commands)
    add_leave_parser(commands)
    add_cluster_parser(commands)
    parser.set_defaults(
        own_process=False
    )  # True when main() runs as the program: [Note: forked workers]
    # `bench` (benchmarks/) will be registered here as a third command.
    return parser


def _flags(args: argparse.Namespace) -> dict[str, dict]:
    """The config fields given on the command line, as {section: {field: value}}."""
    given: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            given.setdefault(section, {})[name] = tuple(value) if isinstance(value, list) else value
    return given


def cluster_topology(args: argparse.Namespace) -> Topology | None:
    """Where this process stands, as the scheduler or launcher that started it says (Slurm,
    Kubeflow, torchrun, Ray, MPI: launch/environments.py), or None when none did; ConfigError
    on an inconsistent allocation."""
    environment = detect(os.environ)
    if environment is None:
        return None
    asked = getattr(args, "launch.nproc", None)
    if args.resume == "auto":  # the command as a new run: its run directory may not exist yet
        args = argparse.Namespace(**{**vars(args), "resume": None})
    return environment.topology(asked, default=resolve_config(args, None).launch.nproc)


def default_out(config: RunConfig) -> str:
    """runs/<date>-<time>-<model>, with a suffix if that exists already."""
    from .train.model_source import RunModel

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{stamp}-{RunModel(config.model).short_name}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return str(candidate)


def resolve_config(args: argparse.Namespace, decided: dict | None) -> RunConfig:
    """Defaults < the TOML file (or the resumed run's config.toml) < flags < `decided`: the
    [launch] fields that the scheduler or launcher that started this process decides
    (`Topology.launch_fields`)."""
    from .train.checks import keep_global_batch, resolve_batch

    given = _flags(args)
    train_flags = given.get("train", {})
    if "batch" in train_flags and "global_batch" in train_flags:
        raise ConfigError(
            "--batch / --global-batch", "both given", "give the per-rank batch or the global one"
        )
    if "batch" in train_flags:  # a --batch flag overrides a global_batch from the file
        given["train"]["global_batch"] = 0
    if args.resume:
        run_dir, _ = split_resume(args.resume)
        if args.config:
            raise ConfigError(
                "--config", "cannot be combined with --resume", "the run's config.toml is used"
            )
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(
                "--resume", f"{run_dir} holds no run (no config.toml)", "give a run directory"
            )
        out = given.get("launch", {}).get("out")
        if out and Path(out).resolve() != run_dir.resolve():
            raise ConfigError("--out", f"differs from --resume {run_dir}", "leave --out out")
        base = load_toml(run_dir / "config.toml").replace(launch={"out": str(run_dir)})
        # The interruption that ended the first session is not part of the run: resume to the end
        # unless --stop-after is given again.
        base = base.replace(train={"stop_after": 0})
    else:
        base = load_toml(args.config) if args.config else RunConfig()
    config = base.replace(**given)
    if decided:
        config = config.replace(launch=decided)
    if not config.launch.out:
        config = config.replace(launch={"out": default_out(config)})
    config = resolve_batch(config)
    if args.resume:  # another world size keeps the global batch ([Note: resize] in checks.py)
        config = keep_global_batch(base, config, train_flags)
    return config


def split_resume(path: str) -> tuple[Path, str]:
    """(run directory, checkpoint name) of --resume RUN or --resume RUN/checkpoint/step-N."""
    given = Path(path)
    if given.parent.name == "checkpoint" and (given.parent.parent / "config.toml").is_file():
        return given.parent.parent, given.name
    return given, ""


def resume_auto(args: argparse.Namespace, decided: dict | None) -> tuple[RunConfig, bool]:
    """`--resume auto`: (this command's config, whether its --out has a checkpoint to resume).

    The command is resolved as a new run; its run directory then decides. A mismatch with the
    run found there (another model, another global batch) is refused in one line.
    """
    from .train.checks import check_same_command

    args.resume = None
    out = _flags(args).get("launch", {}).get("out")
    if not out and not (args.config and load_toml(args.config).launch.out):
        raise ConfigError(
            "--resume auto", "needs the run directory", "give --out RUN_DIR (the same each time)"
        )
    config = resolve_config(args, decided)
    resume = check_same_command(config)
    return config, resume


def cmd_train(args: argparse.Namespace) -> int:
    """train a model with data-parallel workers

    Train a model with data-parallel workers. Flags override --config.
    """
    from .data.cache import use_cache_dir
    from .train.checks import check_values, preflight

    use_cache_dir(args.cache_dir)  # before the checks, which look for cache entries
    auto = args.resume == "auto"
    resume = bool(args.resume)
    checkpoint = split_resume(args.resume)[1] if resume and not auto else ""
    try:
        topology = cluster_topology(args)
        if args.own_process and not (topology and topology.worker):
            launcher_threads()  # its workers are forked from it: [Note: forked workers]
        fields = topology.launch_fields() if topology else None
        if auto:
            config, resume = resume_auto(args, fields)
        else:
            config = resolve_config(args, fields)
        if args.print_config:
            check_values(config)
            print(to_toml(config), end="")
            return 0
        preflight(config, resume=resume, checkpoint=checkpoint, again=auto)
    except ConfigError as error:
        return refused("train", error)
    if topology and not (topology.worker and topology.rank):
        print(f"dataparallel train: {topology.describe()}", flush=True)
    if topology and topology.worker:  # started as a worker: train in place
        from .launch.workers import fair_threads
        from .train.worker import run_worker

        if config.launch.recovery == "live":
            label = "--recovery (launch.recovery)"
            print(
                f"dataparallel train: error: {label}: live needs dataparallel's own launcher, "
                f"not a {topology.source}; run dataparallel train --recovery live (under Slurm: "
                "one task per node)",
                file=sys.stderr,
            )
            return 2
        os.environ.update(topology.worker_variables())
        if not config.launch.threads and "OMP_NUM_THREADS" not in os.environ:
            # srun and mpirun set no threads ([Note: threads per worker] in launch/workers.py)
            config = config.replace(launch={"threads": fair_threads(topology.nproc)})
        run_worker(config, resume=resume, checkpoint=checkpoint)
        return 0
    from .launch.preemption import PREEMPTED, exit_now
    from .train.launch import launch

    code = launch(config, resume=resume, checkpoint=checkpoint, fork=args.own_process)
    if code == PREEMPTED:  # the scheduler's grace runs: no interpreter finalization
        exit_now(code)  # ([Note: preemption] in launch/preemption.py)
    return code


def cmd_sample(args: argparse.Namespace) -> int:
    """sample text from trained weights

    Continue one prompt: a built-in GPT's run (its own sampler, as always), or a Hugging Face
    model (a save_pretrained directory, or a run's hf/ export) through generate's decoder.
    """
    import torch

    from .infer.model_loading import find_model, load_model
    from .infer.sampling import generate

    # One sequence, one token at a time: small matrices that more threads barely speed up, and
    # threads that wait for busy cores slow down a lot.
    torch.set_num_threads(args.threads)
    try:
        loaded = load_model(find_model(args.run))
    except ConfigError as error:
        return refused("sample", error)
    if loaded.kind == "gpt":
        torch.manual_seed(args.seed)
        text = generate(
            loaded.model,
            args.prompt.encode(),
            args.tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            block_size=loaded.context,
        ).decode("utf-8", errors="replace")
    else:
        from .infer.decoding import Sampling, decode

        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
        prompt = loaded.tokenizer.encode(args.prompt or "\n")
        (new,) = decode(loaded, [prompt], [0], args.tokens, sampling)
        text = loaded.tokenizer.decode(prompt + new)
    sys.stdout.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own: [Note: frozen imports] in launch/workers.py
        freeze_imports()
    args = build_parser().parse_args(argv)
    args.own_process = argv is None  # may fork its workers: [Note: forked workers]
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

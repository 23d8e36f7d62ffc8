"""`dataparallel plan`: the planner's command line (cli.py registers it)."""

from __future__ import annotations

import argparse
import sys

from ..launch.command import add_command, refused


def add_plan_parser(commands) -> None:
    p = add_command(commands, "plan", cmd_plan)
    p.add_argument("--model", help="a built-in model (gpt-small, ..., llama-8b)")
    p.add_argument("--params", type=float, help="a bare parameter count, e.g. 7.5e9")
    p.add_argument("--layers", type=int, default=0, help="blocks (with --params)")
    p.add_argument("--width", type=int, default=0, help="residual width (with --params)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (with --params)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's)")
    p.add_argument("--ranks", type=int, help="ranks in the job")
    p.add_argument("--nodes", type=int, help="nodes (with --ranks-per-node)")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node (default: the profile's)")
    p.add_argument("--hardware", default="h100-node", help="a built-in profile or a JSON file")
    p.add_argument("--precision", default="fp32", help="fp32, bf16, bf16-params or fp16")
    p.add_argument(
        "--optimizer", default="adamw", help="adam, adamw, sgd, muon, adafactor or bytes/parameter"
    )
    p.add_argument("--micro-batch", type=int, default=1, help="samples per rank per forward")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    p.add_argument("--strategy", action="append", help="plan only these (repeatable)")
    p.add_argument("--shard-size", type=int, action="append", help="mesh shard size S")
    p.add_argument("--compress", default="none", help="powersgd:R, topk:RHO, int8, fp8, bf16")
    p.add_argument("--diloco-steps", type=int, default=100, help="DiLoCo inner steps H")
    p.add_argument("--fragments", type=int, default=-1, help="DiLoCo fragments F (recipe's)")
    p.add_argument("--overlap", type=int, default=-1, help="DiLoCo overlap tau (recipe's)")
    p.add_argument(
        "--outer-compress", default="recipe", help="recipe (int4), fp32, bf16, int8, fp8 or int4"
    )
    p.add_argument(
        "--outer-lr",
        type=float,
        default=-1.0,
        help="DiLoCo's outer learning rate (-1: chosen for the run, as the job chooses it)",
    )
    p.add_argument(
        "--outer-momentum", type=float, default=-1.0, help="DiLoCo's outer momentum (-1: chosen)"
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--layout", default="dataparallel", help="dataparallel or zero-paper")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (1: none)")
    p.add_argument("--lora", default="", help="a LoRA fine-tune: train's --lora spec, base frozen")
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the real engine for the ranks that differ on a fake process group, beside "
        "the plan; exit 1 where they differ (docs/plan.md)",
    )
    p.add_argument("--calibrate", action="store_true", help="measure this machine (2 ranks)")
    p.add_argument("--out", help="with --calibrate: where to write the profile JSON")
    p.add_argument("--batch", type=int, default=4, help="with --calibrate: samples per rank")


def cmd_plan(args: argparse.Namespace) -> int:
    """predict memory per rank and step time of every strategy, before launch

    Predict per-rank memory, traffic and step time of ddp, zero1/2/3 on every mesh, and
    DiLoCo; recommend the fastest that fits (docs/plan.md).
    """
    from .errors import PlanError

    try:
        if args.calibrate:
            from .calibrate import calibrate

            profile = calibrate([args.model or "gpt-small"], batch=args.batch, out=args.out)
            print(profile.to_json())
            return 0
        return _dry_run(args) if args.dry_run else _plan(args)
    except PlanError as error:
        return refused("plan", error)


# The flags that are dp.plan's arguments of the same name.
SAME_NAMES = (
    *("params", "layers", "width", "seq_len", "vocab"),
    *("ranks", "nodes", "ranks_per_node", "hardware"),
    *("optimizer", "micro_batch", "accumulation", "layout", "lora"),
)


def _plan(args: argparse.Namespace) -> int:
    from .api import checked_steps, plan
    from .inputs import STRATEGIES, parse_compress, plan_recipe
    from .render import as_json, as_table

    compress, arg = parse_compress(args.compress)
    recipe = plan_recipe(  # what `dataparallel train` would compose, its rules checked there
        precision=args.precision,
        tp=args.tp,
        activation_checkpointing=args.activation_checkpointing,
        diloco=checked_steps(args.diloco_steps),
        fragments=args.fragments,
        overlap=args.overlap,
        outer_compress=args.outer_compress,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    result = plan(
        args.model,
        **{name: getattr(args, name) for name in SAME_NAMES},
        strategies=args.strategy or STRATEGIES,
        shard_sizes=args.shard_size,
        compress=compress,
        compress_arg=arg,
        recipe=recipe,
    )
    print(as_json(result) if args.json else as_table(result))
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    """[Note: dry run of a plan] in dry_run.py: one strategy and shard size, printed beside
    the plan (as JSON with --json); 1 when they differ (held bytes, collectives, or the peak by more than
    PEAK_TOLERANCE where it is compared)."""
    from .dry_render import as_json, render
    from .dry_run import dry_run
    from .errors import PlanError

    if args.params is not None:
        raise PlanError(
            "--params",
            "a bare parameter count names no architecture to run",
            "give --model NAME with --dry-run",
        )
    if args.model is None or args.ranks is None:
        raise PlanError("--dry-run", "needs --model and --ranks", "give both")
    if len(args.strategy or []) != 1 or len(args.shard_size or [None]) != 1:
        raise PlanError(
            "--strategy",
            "a dry run runs one strategy on one shard size",
            "give --strategy once (and --shard-size at most once)",
        )
    result = dry_run(
        args.model,
        ranks=args.ranks,
        strategy=args.strategy[0],
        shard_size=(args.shard_size or [None])[0],
        tp=args.tp,
        precision=args.precision,
        optimizer=args.optimizer,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        lora=args.lora,
    )
    print(as_json(result) if args.json else render(result))
    differences = result.differences() + result.peak_differences()
    if differences:
        print(
            f"dataparallel plan --dry-run: {len(differences)} differences from the plan, the "
            f"first: {differences[0]}",
            file=sys.stderr,
        )
        return 1
    return 0

"""One worker of `dataparallel train`: joins the process group, trains, and (the writer) reports.

The launcher (train/launch.py, through launch/workers.py) starts the workers through torch.distributed.run with the
resolved, already validated config in the environment variable DATAPARALLEL_RUN. Started by
`torchrun -m dataparallel.cli train ...` directly, each worker resolves and validates the flags
itself (cli.py) and then comes here.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import dataparallel as dp

from ..checkpoint import CheckpointError, latest_checkpoint
from ..comm.plain import all_gather_plain
from ..comm.progress import CollectiveMismatch, watched
from ..data.formats import DataError
from ..launch.preemption import PREEMPTED, WorkerSignals, exit_now, signals_allowed
from ..launch.workers import ENV_LAUNCHER, freeze_imports
from .callbacks import Callback
from .checkpointing import CheckpointSaver, restore
from .config import RunConfig, field_label
from .config_toml import to_toml
from .handoff import ENV_RUN, decode_run
from .live.recovery import Dropped, LiveRecovery, Released
from .live.replica import ReplicaLost
from .loop import fit
from .preemption import Preempted, Preemption, preempted_message
from .run_dir import CHECKPOINTS, RUN_INFO
from .state import TrainState
from .tensor_parallel import parameter_count
from .tracing import TraceWriter, parse_steps
from .trainer import setup
from .writer import RecordsWriter

CONFIG_FILE = "config.toml"
# Rank 0's line off the main thread ([Note: signals on the main thread] in launch/preemption.py)
NO_PREEMPTION = (
    "dataparallel train: not on the process's main thread (as under Ray Train): no signal "
    "handlers, so a SIGTERM or SIGUSR1 is the process's own and saves no checkpoint; "
    "checkpoint with --checkpoint-every"
)


def restarted() -> int:
    """How many times torchrun's agent has restarted the workers (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def agree_on_config(config: RunConfig, world: dp.World) -> RunConfig:
    """Rank 0's config, after checking that every rank was given the same one.

    Only the run directory may differ (its default name holds the time, which differs from
    machine to machine); rank 0 decides it. Every rank sees every config, so all of them raise
    the same error together rather than some hanging in a later collective.
    """
    if world.world_size == 1:
        return config
    with watched(world.group, "all_gather_object", what="config"):  # JSON, never a pickle
        everyone = all_gather_plain(config.to_dict(), group=world.group)

    def comparable(d: dict) -> dict:
        return {**d, "launch": {**d["launch"], "out": "", "node_rank": 0}}

    for rank, theirs in enumerate(everyone):
        if comparable(theirs) != comparable(everyone[0]):
            raise ValueError(
                f"rank {rank} was started with a different configuration than rank 0; "
                "give every node the same flags and config file"
            )
    chosen = everyone[0]["launch"]["out"]
    return config.replace(launch={"out": chosen})


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dataparallel")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "unknown"


def run_info(state: TrainState, threads: int, previous: dict | None) -> dict:
    """run.json: what ran, on what data, with which software (and when it was resumed)."""
    config, corpus = state.config, state.corpus
    block = config.data.block_size
    global_batch = state.global_batch
    now = datetime.datetime.now().isoformat(timespec="seconds")
    info = {
        "model": config.model.name,
        "parameters": parameter_count(state.model, config),
        "strategy": config.launch.strategy,
        "world_size": state.world.world_size,
        "tp": config.launch.tp,
        "threads": threads,
        "device": state.world.device.type,
        "backend": state.world.backend,
        "global_batch": global_batch,
        "tokens_per_step": global_batch * block,
        "steps": config.train.steps,
        "optimizer": state.config.optim.optimizer,
        "peak_lr": state.peak_lr,
        "corpus": {
            "description": "built-in corpus (stdlib .py)"
            if not config.data.paths
            else corpus.source,
            "source": corpus.source,
            "sha256": corpus.sha256,
            "files": corpus.num_files,
            "tokens": corpus.num_tokens,
            "target_tokens": corpus.target_tokens,  # the ones the loss counts
            "formats": list(getattr(corpus, "formats", ("text",))),
            "tokenizer": getattr(corpus, "tokenizer", "bytes-v1"),  # its fingerprint
            "train_windows": len(state.train_windows),
            "val_windows": len(state.val_windows),
            "block_size": block,
        },
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dataparallel": _package_version(),
        },
        "started_at": now,
        "resumed_at": [],
    }
    if previous:
        info["started_at"] = previous.get("started_at", now)
        info["resumed_at"] = previous.get("resumed_at", []) + [{"step": state.step, "at": now}]
    return info


def prepare(
    config: RunConfig,
    world: dp.World,
    *,
    resume: bool,
    checkpoint: str = "",
    joining: bool = False,
) -> tuple[TrainState, list]:
    """Build (or restore) the run's state and this process's callbacks; rank 0 writes
    config.toml, and the writer run.json ([Note: the writer role] in writer.py). joining: a
    live run's replacement, built in a world of its own before it joins: it writes neither.

    [Note: restarts] When a worker dies, torchrun's agent stops the others and starts them all
    again (up to launch.max_restarts times). A restarted worker resumes by itself from the
    latest complete checkpoint, or starts the run over when there is none yet; training is
    deterministic, so the run ends with the weights an uninterrupted run would have
    (docs/faults.md: 20 of 20 kill trials bit-identical).
    """
    run_dir = Path(config.launch.out)
    if restarted() and not resume:
        resume = latest_checkpoint(run_dir / CHECKPOINTS) is not None
    threads = torch.get_num_threads()
    if world.is_main and not joining:
        run_dir.mkdir(parents=True, exist_ok=True)
        header = "The resolved configuration of this run (dataparallel train --resume reads it)."
        (run_dir / CONFIG_FILE).write_text(to_toml(config, header=header))
    state = setup(config, world)
    if resume:
        restore(state, run_dir, checkpoint)
    info = None
    if not joining:  # every rank has it: a live run's writer may change ([Note: the writer role])
        previous = None
        if resume and (run_dir / RUN_INFO).exists():
            previous = json.loads((run_dir / RUN_INFO).read_text())
            if previous.get("corpus", {}).get("sha256") != state.corpus.sha256 and world.is_main:
                print("warning: the corpus changed since this run began (sha256 differs)")
        info = run_info(state, threads, previous)
    # The writer first, so that a checkpoint follows the metrics of its step.
    callbacks: list[Callback] = [
        RecordsWriter(
            run_dir,
            info,
            log_every=config.train.log_every,
            threads=threads,
            report_to=config.train.report_to,
        ),
        CheckpointSaver(run_dir, config.train.checkpoint_every, config.train.checkpoint_save),
    ]
    if config.train.trace:  # after the checkpoint, so that its gathers stay out of the trace
        callbacks.append(TraceWriter(run_dir, *parse_steps(config.train.trace)))
    return state, callbacks


@dataclass(frozen=True)
class Exit:
    """How `run_worker` ends on one kind of error: with `code`, after `leave` (each callback's
    on_leave: the writer closes its files or hands its role over) and `finish` (a background
    checkpoint finishes), with the line `say(error, state, out)` printed by rank 0 of the run
    (`everyone`: by every rank, each about itself) to stdout or stderr."""

    code: int
    say: Callable[[BaseException, TrainState | None, str], str]
    everyone: bool = False
    stderr: bool = True
    leave: bool = False
    finish: bool = False


def _interrupted(error, state, out: str) -> str:
    latest = latest_checkpoint(Path(out) / CHECKPOINTS)
    where = f"the last checkpoint is {latest.name}" if latest else "no checkpoint yet"
    line = f"\ninterrupted at step {state.step if state else 0}; {where}"
    return line + (f"\ncontinue with: dataparallel train --resume {out}" if latest else "")


def _preempted(error, state, out: str) -> str:
    return preempted_message(error, out)


def _live(error, state, out: str) -> str:
    return f"dataparallel train: live: {error}"


def _error(error, state, out: str) -> str:
    return f"dataparallel train: error: {error}"


def _data_error(error, state, out: str) -> str:
    return f"dataparallel train: error: {field_label('data', 'paths')}: {error}"


# Each error the run ends on, and how (the first entry that matches): one short note instead of
# a traceback from every rank.
EXITS: tuple[tuple[type | tuple[type, ...], Exit], ...] = (
    (KeyboardInterrupt, Exit(130, _interrupted, stderr=False, finish=True)),
    (Preempted, Exit(PREEMPTED, _preempted, stderr=False, leave=True)),
    # the others go on without this replica
    ((Dropped, ReplicaLost), Exit(1, _live, everyone=True)),
    # asked to leave (dataparallel leave): the others go on
    (Released, Exit(0, _live, everyone=True, leave=True, finish=True)),
    # the user's to fix, not a bug
    ((FloatingPointError, CollectiveMismatch), Exit(1, _error, finish=True)),
    # every rank raises these together (restore broadcasts; data/loading.py)
    (CheckpointError, Exit(2, _error)),
    (DataError, Exit(2, _data_error)),
)
EXIT_ERRORS = tuple(
    kind for kinds, _ in EXITS for kind in (kinds if isinstance(kinds, tuple) else (kinds,))
)


def _exit(error: BaseException, state, world: dp.World, callbacks, out: str) -> int:
    """Do what `EXITS` says for `error`; return its exit code."""
    how = next(how for kinds, how in EXITS if isinstance(error, kinds))
    if how.leave:
        for callback in callbacks or []:
            callback.on_leave(state)
    if how.finish:
        _finish_saving(callbacks)
    if how.everyone or _is_main(state, world):
        print(how.say(error, state, out), file=sys.stderr if how.stderr else sys.stdout, flush=True)
    return how.code


def run_worker(config: RunConfig, *, resume: bool, checkpoint: str = "") -> None:
    """Train one rank of the run `config` describes; rank 0 writes the run directory.

    Exits (SystemExit) with 130 on Ctrl-C and 1 when the loss diverges or the ranks call
    different collectives (--check-collectives), with one short note from rank 0 instead of a
    traceback from every rank. A collective that waits longer than --collective-timeout ends
    the process from the watchdog's thread (docs/watchdog.md). Exits PREEMPTED (75) after a
    SIGTERM or SIGUSR1, with the step every rank stopped at saved ([Note: preemption] in
    launch/preemption.py; a live run takes no part, nor a worker off the main thread: [Note:
    signals on the main thread]).
    """
    launch = config.launch
    live = LiveRecovery.from_environment(launch)  # [Note: live recovery] in live/recovery.py
    launcher = os.environ.get(ENV_LAUNCHER)  # our launcher's pid: it marks a preemption
    signals = None
    if live is None and signals_allowed():
        signals = WorkerSignals(int(launcher) if launcher else None).install()
    preempted = False
    world = dp.init(
        threads=launch.threads or None,
        collective_timeout=0 if live else launch.collective_timeout,
        check_collectives=launch.check_collectives,
    )
    if live is None and signals is None and world.is_main:
        print(NO_PREEMPTION, file=sys.stderr, flush=True)
    state = callbacks = None
    try:
        if live is not None and not live.joining:
            world = live.enter(world)  # generation 0 with the workers started together
        config = agree_on_config(config, world)
        if live is not None and live.joining:  # built alone, then healed by a member
            world = live.alone(world)  # an HSDP replica: its own S processes
            state, callbacks = prepare(config, world, resume=False, joining=True)
            live.join(state)
        else:
            state, callbacks = prepare(config, world, resume=resume, checkpoint=checkpoint)
        if signals is not None:
            saver = next(c for c in callbacks if isinstance(c, CheckpointSaver))
            callbacks.append(Preemption(signals, saver))
        fit(state, callbacks, live)
        world = state.world  # a live run's replacement ends in the run's world, not its own
        if world.is_main:  # the writer: the report's plots go to the trackers too
            print(_writer(callbacks).report(state), flush=True)
    except EXIT_ERRORS as error:
        preempted = isinstance(error, Preempted)  # every rank saved the same step
        raise SystemExit(_exit(error, state, world, callbacks, config.launch.out)) from None
    finally:
        if callbacks:  # a run that failed: the trackers still open say so (none after report)
            _writer(callbacks).close_trackers(ok=False)
        if signals is not None and signals.received is not None and not preempted:
            _end_as_told(signals.received.name)  # os._exit: no destructor runs, no teardown
        # [Note: teardown] Drop the model, optimizer and strategies (which hold the process group)
        # *before* destroying the group. Left to the interpreter's exit, the group's C++ object was
        # destroyed during finalisation and aborted about one rank exit in 25 ("terminate called
        # without an active exception"): 2 of 48 before this, 0 of 60 after.
        state = callbacks = live = None  # live: its abandoned groups ([Note: abandoned groups])
        gc.collect()
        dp.destroy()
        if preempted:  # the budget runs: no interpreter finalization ([Note: preemption])
            exit_now(PREEMPTED)


def _writer(callbacks: list) -> RecordsWriter:
    return next(c for c in callbacks if isinstance(c, RecordsWriter))


def _end_as_told(signal_name: str) -> None:
    """A worker told to end (SIGTERM, SIGUSR1) that fails before it could save (the agent stops
    the workers after another one died; a peer is gone): end now, as the signal's default action
    did before preemption was handled, with one line instead of a traceback from every rank."""
    error = sys.exc_info()[1]
    if isinstance(error, SystemExit):
        exit_now(error.code if isinstance(error.code, int) else 1)
    if error is None:  # the run ended before the flag was read (in its final save)
        exit_now(0)
    print(f"dataparallel train: {signal_name}, then: {error!r}"[:300], file=sys.stderr)
    exit_now(1)


def _is_main(state, world: dp.World) -> bool:
    """Whether this process speaks for the run: rank 0 of the run's world (a live run's
    replacement is built in a world of its own before it joins)."""
    return (state.world if state is not None else world).is_main


def _finish_saving(callbacks) -> None:
    """Let a checkpoint being written in the background finish before the process ends."""
    for callback in callbacks or []:
        if isinstance(callback, CheckpointSaver):
            try:
                callback.close(timeout=60)
            except Exception:  # noqa: BLE001 - the interruption is what the user sees
                pass


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this worker when its parent, the launcher, dies: a launcher killed
    with `kill -9` cannot stop its workers itself, and orphans would go on writing the run."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask
        return
    # The launcher may have died while this process was still importing torch, before asking.
    launcher = os.environ.get(ENV_LAUNCHER)
    if launcher and os.getppid() != int(launcher):
        os._exit(1)


def main() -> int:
    """Entry point of a worker started by the launcher (`python -m dataparallel.train.worker`)."""
    freeze_imports()  # [Note: frozen imports] in launch/workers.py
    die_with_launcher()
    config, resume, checkpoint = decode_run(os.environ[ENV_RUN])
    run_worker(config, resume=resume, checkpoint=checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())

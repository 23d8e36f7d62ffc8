"""What rank 0 prints: the run's header (global batch composition) and a progress bar.

On a terminal the bar redraws one line in place; otherwise (a log file, a CI job, a test) it
prints a plain line every `log_every` steps, so logs stay readable.
"""

from __future__ import annotations

import sys
import time

from ..data.stream import share
from .callbacks import Callback
from .ledger import EvalRecord, StepRecord
from .state import TrainState
from .sync import recipe_of
from .tensor_parallel import mesh_text, parameter_count


def format_duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s, 0.8s."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def plural(n: int, word: str) -> str:
    """1 file, 2 files."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_count(n: float) -> str:
    """12.3k, 4.56M, 789."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def describe_split(global_batch: int, accum: int, world_size: int) -> str:
    """'8 = 3,3,2 windows per rank' ([Note: uneven batches] in trainer.py), or '8 = 4 windows
    per rank' when the ranks share it equally; ' in N micro-steps' when accum N > 1."""
    counts = [share(global_batch, rank, world_size) for rank in range(world_size)]
    each = str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))
    steps = f" in {accum} micro-steps" if accum > 1 else ""
    return f"{global_batch} = {each} windows per rank{steps}"


def describe_run(state: TrainState, threads: int) -> list[str]:
    """The header lines: model, data, processes, global batch and LR schedule."""
    config, world, corpus = state.config, state.world, state.corpus
    train, optim = config.train, config.optim
    params = parameter_count(state.model, config)
    block = config.data.block_size
    global_batch = state.global_batch
    source = "built-in corpus (stdlib .py)" if not config.data.paths else corpus.source
    scaling = (
        f"linear scaling {optim.lr:g} x {global_batch}/{optim.lr_base_batch}"
        if optim.lr_scaling == "linear"
        else "no scaling"
    )
    return [
        f"model   {config.model.name}, {params / 1e6:.2f}M parameters, {train.precision}",
        f"data    {source}: {_tokens_text(corpus)}, "
        f"sha256 {corpus.sha256[:12]}; {len(state.train_windows)} train / "
        f"{len(state.val_windows)} val windows of {block} tokens",
        f"world   {mesh_text(world.world_size, config.launch.tp)} ({config.launch.strategy}, "
        f"{world.backend}, "
        f"{world.device.type}, {plural(threads, 'thread')} each){_sync_text(state)}",
        _batch_text(train, state.layout.data_size, global_batch, block, config.launch.tp),
        f"optim   {optim.optimizer}, lr peak {state.peak_lr:.3g} ({scaling}), {optim.warmup_steps} warm-up steps, "
        f"cosine to {state.peak_lr * optim.min_lr_ratio:.3g} at step {train.steps}",
    ]


def _batch_text(train, world_size: int, global_batch: int, block: int, tp: int = 1) -> str:
    """world_size: the ranks that read different data (the dp ones under --tp)."""
    tokens = f"{global_batch * block} tokens/step"
    if global_batch == train.batch * train.accum * world_size:
        ranks = "ranks" if tp == 1 else "dp ranks"
        return (
            f"batch   global batch = {train.batch} per rank x {train.accum} accum x "
            f"{world_size} {ranks} = {global_batch} windows = {tokens}"
        )
    split = describe_split(global_batch, train.accum, world_size)
    return f"batch   global batch {split} (uneven) = {tokens}"


def _tokens_text(corpus) -> str:
    """'12.3kB in 4 files' for text read as bytes; else '4.5k tokens in 1 file (1.2k counted by
    the loss)' (data/loading.py DataInfo)."""
    total, counted = corpus.num_tokens, corpus.target_tokens
    # A Corpus (setup's argument) is text read as bytes; a DataInfo says what it is.
    as_bytes = getattr(corpus, "tokenizer", "bytes-v1") == "bytes-v1"
    as_bytes = as_bytes and getattr(corpus, "formats", ("text",)) == ("text",)
    size = f"{format_count(total)}B" if as_bytes else f"{format_count(total)} tokens"
    loss = f" ({format_count(counted)} counted by the loss)" if counted < total else ""
    return f"{size} in {plural(corpus.num_files, 'file')}{loss}"


def _sync_text(state: TrainState) -> str:
    """How the ranks synchronise, when not exactly every step (train/sync.py)."""
    config = state.config
    sync = config.sync
    if sync.local_sgd:
        return f"; local SGD every {sync.local_sgd} steps"
    if sync.diloco:  # [Note: the DiLoCo recipe], [Note: the outer learning rate]
        recipe = recipe_of(config, config.launch.strategy)
        s = recipe.streaming
        outer = state.composed.outer if state.composed is not None else None
        outer = outer or recipe.outer(state.layout.replicas, config.optim.optimizer)
        return (
            f"; DiLoCo every {sync.diloco} steps ({outer.describe()}, {s.compress or 'fp32'} "
            f"outer gradients, {s.fragments} fragments, overlap {s.overlap}, {s.warmup} warm-up "
            "steps)"
        )
    return f"; gradients compressed: {sync.compress}" if sync.compress else ""


class ProgressBar(Callback):
    """Rank 0's progress: step, loss, tokens/s and ETA.

    stream: where to print (stdout).
    log_every: steps between lines when not on a terminal.
    interactive: redraw in place; None asks the stream whether it is a terminal.
    """

    def __init__(self, stream=None, *, log_every: int = 25, threads: int = 1, interactive=None):
        self.stream = stream or sys.stdout
        self.log_every = max(1, log_every)
        self.threads = threads
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.step_time = None  # exponential moving average, for the ETA
        self.on_line = False

    def _print(self, text: str) -> None:
        if self.on_line:
            self.stream.write("\n")
            self.on_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def on_start(self, state: TrainState) -> None:
        self.started = time.perf_counter()
        for line in describe_run(state, self.threads):
            self._print(line)
        if state.step:
            self._print(f"resumed at step {state.step} of {state.config.train.steps}")

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        if self.step_time is None or record.step <= 2:
            self.step_time = record.step_time_s  # the first steps include warm-up costs
        else:
            self.step_time = 0.9 * self.step_time + 0.1 * record.step_time_s
        total, last = state.config.train.steps, state.last_step
        eta = format_duration(self.step_time * (last - record.step))
        text = (
            f"step {record.step:>{len(str(total))}}/{total} | loss {record.loss:.4f} | "
            f"lr {record.lr:.2e} | {format_count(record.tokens_per_s)} tok/s | ETA {eta}"
        )
        if self.interactive:
            width = 20
            filled = int(width * record.step / total)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {text}  ")
            self.stream.flush()
            self.on_line = True
        elif record.step % self.log_every == 0 or record.step in (1, last):
            self._print(text)

    def on_eval(self, state: TrainState, record: EvalRecord) -> None:
        self._print(
            f"step {record.step}: val loss {record.val_loss:.4f} "
            f"({format_count(record.tokens)} tokens, {format_duration(record.eval_time_s)})"
        )

    def on_end(self, state: TrainState) -> None:
        if self.on_line:
            self.stream.write("\n")
            self.on_line = False
        self.stream.flush()

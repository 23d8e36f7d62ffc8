"""The training loop: build the pieces, step, evaluate, and call back. Runs on every rank.

    state = setup(config, world)                 # data, model, optimizer, sample stream
    record = train_step(state)                   # one step ([Note: loss normalisation])
    fit(state, callbacks)                        # the loop (train/loop.py)

[Note: loss normalisation] The loss of a step is the summed token cross-entropy of the whole
global batch (every rank, every micro-step) divided by the number of target tokens in it, so the
result does not depend on how the batch is split into ranks and micro-steps. The strategy
*averages* gradients over ranks (DDP's "mean"), so each rank backpropagates
    sum of its micro-batch's token losses x world_size / global target tokens,
and after the averaging the gradient is exactly d(global sum / global tokens). Averaging each
micro-batch's mean loss instead would weight tokens unequally as soon as micro-batches hold
different numbers of targets. The global token count is one small all-reduce per step (with
fixed-length windows it is also the global batch x block, which the header prints).
Under --tp the ranks that read different data are the dp ones ([Note: the job's mesh] in
train/tensor_parallel.py): the scale is dp size / global tokens, and since the T peers of a
row hold the same tokens and loss, only the first of each row adds them to the sums.
Only targets the loss counts are counted: for prompt/completion and chat data the masked ones
(IGNORE, [Note: loss masking] in data/packing.py) are neither in the sum nor in the count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import dataparallel as dp

from ..comm import Span
from ..comm.progress import PROGRESS
from ..data.corpus import Corpus, TokenWindows, evenly_spaced
from ..data.loading import load_datasets
from ..data.packing import IGNORE
from ..data.stream import SampleStream
from .config import RunConfig
from .gradient_watch import GradientWatch
from .ledger import EvalRecord, Ledger, StepRecord
from .loss import all_reduce_sum, token_loss_sum
from .lr_schedule import WarmupCosine, scaled_lr
from .model_source import BuiltModel, RunModel, build_for_run
from .optimizers import choose_optimizer
from .state import TrainState
from .step import Vote, forward_backward, own_verdict, set_lr, take_batch, update
from .sync import recipe_of
from .tensor_parallel import build_mesh


def setup(
    config: RunConfig,
    world: dp.World,
    corpus: Corpus | None = None,
    model: torch.nn.Module | None = None,
) -> TrainState:
    """Read the data, build and parallelize the model, build the optimizer and the sample stream.

    corpus: the text (default: read what config.data names).
    model: your own model, mapping token ids (batch, time) to logits (batch, time, vocab) over
        the 256 byte values; default: the reference model config.model.name, built here.
        Build yours after `torch.manual_seed(config.train.seed)` for reproducible runs.
    """
    source = RunModel(config.model)  # resolved once: the name, DIR, its tokenizer
    train_windows, val_windows, corpus = _windows(config, world, source, corpus)
    if model is None:  # [Note: a run's model] in model_source.py
        built = build_for_run(config, world, source)
    else:
        strategy = config.launch.strategy
        built = BuiltModel(model.to(world.device), strategy, None, type(model).__name__)
    model, model_name = built.model, built.name
    mesh = build_mesh(world, config.launch.tp)  # [Note: the job's mesh]: None for --tp 1
    recipe = recipe_of(config, built.strategy)  # the CLI's flags as a dp.Recipe
    # The data ranks set the global batch, which sets the learning rate the optimizer is
    # built with, before compose builds the same Layout ([Note: layout]; pure arithmetic).
    peak_lr = _peak_lr(config, recipe.layout(world.world_size).data_size)
    optim = config.optim
    # [Note: composition] in dataparallel/compose.py: what a script calling dp.compose gets;
    # it splits the model over mesh["tp"] (--tp), recomputes its blocks
    # (--activation-checkpointing) and runs the strategy over mesh["dp"], in that order
    choice = choose_optimizer(optim, model, peak_lr)  # [Note: the job's optimizers]
    composed = dp.compose(
        model,
        recipe,
        choice.cls,
        params=choice.groups,
        group=world.group,
        mesh=mesh,
        **choice.kwargs,
    )
    schedule = WarmupCosine(
        warmup_steps=optim.warmup_steps,
        total_steps=config.train.steps,
        min_ratio=optim.min_lr_ratio,
    )
    samples = SampleStream(len(train_windows), seed=config.train.seed)
    return TrainState(
        config=config,
        world=world,
        model=model,
        model_name=model_name,
        optimizer=composed.optimizer,
        schedule=schedule,
        peak_lr=peak_lr,
        train_windows=train_windows,
        val_windows=val_windows,
        corpus=corpus,
        layout=composed.layout,
        ledger=Ledger(samples=samples),
        scaler=composed.scaler,
        averager=composed.averager,
        tracer=composed.tracer,
        composed=composed,
        source=built.source,
        gradients=GradientWatch(model),
    )


def _windows(config: RunConfig, world: dp.World, source: RunModel, corpus: Corpus | None):
    """The train and validation windows and the corpus: read from what config.data names
    (data/loading.py: every format, tokenized once and cached), or split from `corpus`."""
    data, block = config.data, config.data.block_size
    if corpus is None:
        return load_datasets(
            list(data.paths),
            source.tokenizer(),
            block,
            data.val_fraction,
            world=world,
            token_dtype=data.token_dtype,
        )
    train_tokens, val_tokens = corpus.split(data.val_fraction)
    return TokenWindows(train_tokens, block), TokenWindows(val_tokens, block), corpus


def _peak_lr(config: RunConfig, data_size: int) -> float:
    """The learning rate at the top of the schedule, scaled to the global batch the run's
    `data_size` data ranks make (--lr-scaling); an empty micro-batch is refused."""
    optim, train = config.optim, config.train
    global_batch = train.global_batch or train.batch * train.accum * data_size
    if global_batch < train.accum * data_size:
        raise ValueError(
            f"a global batch of {global_batch} windows leaves a micro-batch of accum "
            f"{train.accum} x {data_size} ranks empty"
        )
    return scaled_lr(
        optim.lr, global_batch, scaling=optim.lr_scaling, base_batch=optim.lr_base_batch
    )


def next_indices(state: TrainState, count: int) -> list[int]:
    """This rank's next `count` samples; the stream then counts exactly the samples trained on
    (every rank's), so its state_dict is the resume point with no prefetch to correct for."""
    return state.ledger.samples.take(count, state.data_rank, state.layout.data_size)


def bytes_sent(state) -> tuple[int, int]:
    """(bytes handed to, bytes put on the wire by) this rank's strategy and averager so far
    ([Note: bytes on the wire] in comm/wire.py)."""
    averager = state.averager
    payload = averager.bytes_sent() if averager is not None else 0
    wire = averager.wire_bytes() if averager is not None else 0
    return dp.bytes_sent(state.model) + payload, dp.wire_bytes(state.model) + wire


def train_step(state: TrainState, before_update: Callable[[], None] | None = None) -> StepRecord:
    """One optimizer step over `accum` micro-batches of this rank's data, in its concerns: the
    data, the loss (forward and backward), this rank's own verdict ([Note: blame]), the vote (one
    all-reduce of the loss, every rank's time and verdict), the update, and the record.

    before_update: called before the update; raises to abandon the step (live recovery of HSDP
        replicas: unless every rank of the replica got through the step's collectives,
        [Note: HSDP replicas] in live/replica.py).

    [Note: uneven batches] A global batch that accum x world size does not divide is shared as
    evenly as it goes: rank r takes its share of the step's samples (SampleStream.take_share:
    the first B % W ranks one more) and cuts it into `accum` micro-batches that differ by at most
    one (the longer first), so any two micro-batches of the step differ by at most one window.
    Every rank still runs `accum` micro-steps, so the collectives pair. The gradient stays
    exactly the global batch's ([Note: loss normalisation]: each rank's token-loss sum is scaled
    by world_size / global tokens, whatever its own count), which tests/dist/test_uneven_batches.py
    checks against one process on the whole batch. Under local SGD / DiLoCo each replica steps
    on its own gradient, which an uneven split scales by the replica's share of the global
    tokens (within a window of the others') until the replicas are averaged.
    """
    started, started_ns = time.perf_counter(), time.perf_counter_ns()
    waited = PROGRESS.waited()  # [Note: blame]: a rank's work time leaves out its waits
    sent_before = bytes_sent(state)
    with state.tracer.span("data"):  # [Note: uneven batches]
        batch = take_batch(state)
        lr = set_lr(state)
    loss_sum = forward_backward(state, batch)
    work_s = time.perf_counter() - started - (PROGRESS.waited() - waited)
    vote = Vote.of(state, loss_sum, work_s, own_verdict(state, loss_sum))
    if before_update is not None:
        before_update()
    grad_norm, skipped, nonfinite = update(state, vote.loss)
    state.ledger.count(skipped, nonfinite)  # and the record
    if state.tracer.enabled:
        span = Span("step", "step", started_ns, time.perf_counter_ns(), {"step": state.step})
        state.tracer.add(span)
    sent = bytes_sent(state)
    scaler = state.scaler
    return StepRecord(
        step=state.step,
        loss=vote.loss / max(batch.global_tokens, 1),
        lr=lr,
        grad_norm=grad_norm,
        tokens=int(batch.global_tokens),
        step_time_s=time.perf_counter() - started,
        elapsed_s=0.0,
        loss_scale=scaler.get_scale() if scaler is not None else 1.0,
        skipped_steps=state.ledger.skipped_steps,
        bytes_sent=sent[0] - sent_before[0],
        wire_bytes=sent[1] - sent_before[1],
        rank_step_s=tuple(round(t, 6) for t in vote.rank_step_s),
        nonfinite_ranks=vote.bad_ranks if nonfinite else (),
    )


@torch.no_grad()
def evaluate(state: TrainState) -> EvalRecord:
    """Mean token loss over the scored validation windows, exact for any world size.

    Data rank r scores windows r, r + data ranks, ... of the chosen set (tp peers the same,
    counted once: [Note: loss normalisation]), so shards may differ in
    length by one and no window is scored twice (a padded sampler would count some twice).
    Each rank sums its token losses and counts its tokens; one all-reduce of the two sums gives
    the exact mean. Every rank runs the same number of forwards, though: a sharded strategy
    (ZeRO-3) gathers parameters collectively inside forward, so a rank that stopped early would
    leave the others waiting. A rank whose shard has run out scores a stand-in window and drops it.
    """
    started = time.perf_counter()
    config, world, size = state.config, state.world, state.layout.data_size
    chosen = evenly_spaced(config.data.eval_windows, len(state.val_windows))
    mine = chosen[state.data_rank :: size]
    longest = -(-len(chosen) // size)  # the longest rank's share
    state.model.eval()
    loss_sum, tokens = 0.0, 0
    try:
        for first in range(0, longest, config.train.batch):
            part = mine[first : first + config.train.batch]
            inputs, targets = state.val_windows.batch(part or chosen[:1])
            summed = token_loss_sum(state, inputs.to(world.device), targets.to(world.device))
            if part:
                loss_sum += float(summed)
                tokens += int((targets != IGNORE).sum())
    finally:
        state.model.train()
    weight = state.loss_weight
    total_loss, total_tokens = all_reduce_sum([loss_sum * weight, tokens * weight], world)
    return EvalRecord(
        step=state.step,
        val_loss=total_loss / max(total_tokens, 1),
        tokens=int(total_tokens),
        eval_time_s=time.perf_counter() - started,
    )

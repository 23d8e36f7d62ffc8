"""The loop: steps and evaluations from `state.step` to the last, and the callbacks that log
and checkpoint on the way. Runs on every rank.

    fit(state, callbacks)                        # train_step and evaluate (train/trainer.py)
    fit(state, callbacks, recovery)              # or: steps that survive a lost replica
"""

from __future__ import annotations

import dataclasses
import time

from .callbacks import Callback
from .config import RunConfig
from .ledger import EvalRecord, StepRecord
from .state import TrainState
from .trainer import evaluate, train_step


class Rewound(Exception):
    """Raised by `Steps` when the state went back to an earlier step (`state.step`): the steps
    and evaluations after it are redone."""


def should_evaluate(config: RunConfig, step: int) -> bool:
    """Whether step `step` ends with a validation pass (step 0 always has one)."""
    every = config.train.eval_every
    return step == config.train.steps or bool(every and step % every == 0)


class Steps:
    """How `fit` runs one training step and one evaluation: `train_step` and `evaluate`.

    Live recovery (train/live/recovery.py) is a subclass that redoes either after the ranks regroup;
    the loop itself does not change.
    """

    def step(self, state: TrainState) -> StepRecord:
        return train_step(state)

    def evaluate(self, state: TrainState) -> EvalRecord:
        return evaluate(state)


def fit(state: TrainState, callbacks: list[Callback], steps: Steps | None = None) -> TrainState:
    """Train from `state.step` to `state.last_step`, evaluating and calling back on the way.

    steps: how a step and an evaluation run (default `Steps()`: as they are).
    """
    steps, ledger = steps or Steps(), state.ledger
    for callback in callbacks:
        callback.on_start(state)
    if state.step == 0 and not ledger.evals:  # a live run's replacement healed at step 0 has one
        _evaluate_and_report(state, callbacks, steps)
    if ledger.fit_started is None:
        ledger.fit_started = time.perf_counter()
    while state.step < state.last_step:
        before = state.step
        try:
            record = steps.step(state)
            if state.step == before:  # skipped on every rank: counted in the next record too
                for callback in callbacks:
                    callback.on_skip(state, record)
                if ledger.consecutive_skips >= state.config.train.max_skips:
                    raise FloatingPointError(_too_many_skips(state, record))
                continue
            record = dataclasses.replace(record, elapsed_s=ledger.elapsed())
            ledger.history.append(record)
            if should_evaluate(state.config, state.step):
                _evaluate_and_report(state, callbacks, steps)
        except Rewound:
            for callback in callbacks:
                callback.on_rewind(state)
            continue
        # After the evaluation, so that a checkpoint written here follows the step's metrics.
        for callback in callbacks:
            callback.on_step(state, record)
    for callback in callbacks:
        callback.on_end(state)
    return state


def _too_many_skips(state: TrainState, record: StepRecord) -> str:
    ranks = record.nonfinite_ranks
    where = ", ".join(map(str, ranks))
    blame = f"; before the reduction it was not finite on rank(s) {where}" if ranks else ""
    return (
        f"{state.ledger.consecutive_skips} steps in a row after step {state.step} had a non-finite "
        f"loss or gradient (the last loss: {record.loss}){blame}; the run stops with its last "
        "checkpoint kept: lower --lr, or use --precision fp32"
    )


def _evaluate_and_report(state: TrainState, callbacks: list[Callback], steps: Steps) -> None:
    evaluation = steps.evaluate(state)
    state.ledger.evals.append(evaluation)
    for callback in callbacks:
        callback.on_eval(state, evaluation)

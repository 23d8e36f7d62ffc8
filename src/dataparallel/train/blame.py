"""Which rank: per-rank step times, stragglers, and the ranks whose gradients were not finite.

[Note: blame] A data-parallel step is as slow as its slowest rank, and a non-finite gradient
is non-finite everywhere once reduced, so neither the step time nor the verdict of
[Note: non-finite steps] says which rank it came from. Each rank therefore measures, per step:
  - its work time: the wall time from the start of the step to the loss's all-reduce, less the
    time its training thread spent blocked in collectives (`Progress.waited`), so that a fast
    rank waiting for a slow one is not charged for the wait;
  - whether its own loss or any of its own gradients was not finite *before* the reduction
    (`GradientWatch` in gradient_watch.py: a hook on each parameter sees the micro-step's
    gradient before it is accumulated and reduced).
Both travel in the step's existing all-reduce of the loss, each rank writing its own slot of
a vector of 1 + 2 x world size numbers, so every rank learns every rank's figures at no extra
collective. `StepRecord.rank_step_s` carries the times (metrics.jsonl), `nonfinite_ranks` the
ranks to blame; `Blame` (rank 0) prints the warnings.

The straggler rule (`StragglerRule`): a rank's score for a step is its work time divided by the
median of the other ranks' work times; a rank whose median score over the last `window` steps
is at least 1 + `slower_by` is named, once, until its median score falls back below it. The
median makes one slow step (a checkpoint written by rank 0, a page fault) count for nothing;
comparing with the *other* ranks keeps the rule meaningful with 2 ranks.
"""

from __future__ import annotations

import statistics
import sys
from collections import deque
from dataclasses import dataclass

from .callbacks import Callback
from .ledger import StepRecord
from .state import TrainState


@dataclass(frozen=True, kw_only=True)
class StragglerRule:
    """When a rank is named as a straggler ([Note: blame]).

    window: the steps a score is taken over (the median of the last `window` steps); no rank is
        named before that many steps have been seen.
    slower_by: how much slower than the other ranks' median a rank must be (0.5: 50 % slower,
        a score of 1.5) to be named.
    """

    window: int = 10
    slower_by: float = 0.5


def step_scores(times: list[float]) -> list[float]:
    """Each rank's work time over the median of the other ranks' (1.0 for a world of one)."""
    scores = []
    for rank, time in enumerate(times):
        others = times[:rank] + times[rank + 1 :]
        typical = statistics.median(others) if others else time
        scores.append(time / typical if typical > 0 else 1.0)
    return scores


class Stragglers:
    """The straggler rule applied step by step ([Note: blame])."""

    def __init__(self, rule: StragglerRule = StragglerRule()):
        self.rule = rule
        self.scores: deque[list[float]] = deque(maxlen=rule.window)
        self.named: set[int] = set()  # ranks named and not yet recovered

    def median_scores(self) -> list[float]:
        """Each rank's median score over the steps seen (up to `window`)."""
        return [statistics.median(column) for column in zip(*self.scores, strict=True)]

    def observe(self, times: list[float]) -> list[int]:
        """Take one step's per-rank work times; return the ranks newly named stragglers."""
        if len(times) < 2:
            return []
        if self.scores and len(self.scores[-1]) != len(times):  # a live run regrouped
            self.scores.clear()
            self.named = set()
        self.scores.append(step_scores(times))
        if len(self.scores) < self.rule.window:
            return []
        slow = {r for r, s in enumerate(self.median_scores()) if s >= 1 + self.rule.slower_by}
        new = sorted(slow - self.named)
        self.named = slow
        return new


def ranks_text(ranks) -> str:
    """'rank 1', 'ranks 0, 2'."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Blame(Callback):
    """Rank 0's warnings: stragglers, and the ranks whose gradients were not finite
    ([Note: blame]). Each warning is one line on stderr (or given to `write`)."""

    def __init__(self, rule: StragglerRule = StragglerRule(), write=None):
        self.stragglers = Stragglers(rule)
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    def on_step(self, state: TrainState, record: StepRecord) -> None:
        for rank in self.stragglers.observe(list(record.rank_step_s)):
            score = self.stragglers.median_scores()[rank]
            self.write(
                f"dataparallel train: warning: rank {rank} is a straggler: its steps took "
                f"{score:.1f}x the other ranks' median work time over the last "
                f"{self.stragglers.rule.window} steps (at step {record.step}; rank_step_s in "
                "metrics.jsonl); look at what else runs on its machine"
            )

    def on_skip(self, state: TrainState, record: StepRecord) -> None:
        if record.nonfinite_ranks:
            self.write(
                f"dataparallel train: warning: step {record.step + 1} skipped: the loss or "
                f"gradient of {ranks_text(record.nonfinite_ranks)} was not finite before the "
                f"reduction ({state.ledger.consecutive_skips} in a row, --max-skips "
                f"{state.config.train.max_skips})"
            )

"""DiLoCo's outer optimizer chosen for the run: its learning rate and Nesterov momentum from the
number of replicas M, the inner steps H and the inner optimizer, as measured here.

Pure functions and a frozen policy, no process group: `dp.Recipe.outer` resolves a recipe's
fields against the table, `compose` builds the outer SGD from the result, and `dataparallel
plan` and the job's first lines print it.

[Note: the outer learning rate] The outer step moves the anchors by the replicas' mean movement
times lr, plus Nesterov momentum: in a steady state about lr / (1 - momentum) times the movement
(0.7 and 0.9: 7x). How far that may reach depends on how much the replicas' movements agree:
the best outer learning rate rises with M and H (Charles et al. 2025, "Scaling Laws for
DiLoCo"; not with the model's size). MuLoCo (arXiv 2505.23725) takes 0.7 and 0.6 under Muon;
here a larger outer step did better (0.7 / 0.6: +1.0% of data-parallel Muon's loss; 0.7 / 0.8:
-1.7%; 1.0 / 0.6: -2.8%), and Muon's cell takes 1.0 / 0.6. `MEASURED` holds each cell's best of the settings tried in docs/compression.md ("The
outer learning rate chosen for the run": gpt-tiny, 1,000 steps, the paper's inner recipe): at
M = 2 a momentum of 0.8 took DiLoCo from +3.6% of DDP's loss (0.9, the paper's) to +0.2%; a
momentum of 0.9 remembers about ten outer steps, too many for a run of 33. A run off the table
takes its nearest cell (M first, then H, on a log scale; ties to the smaller); an inner
optimizer other than Muon takes AdamW's rows; a value given always wins. Streaming DiLoCo has
cells of its own: its overlapped fragments continue half from their local values (`mix`), and
on the recipe at M = 2 the paper's 0.9 beat 0.8 (+1.9% against +3.0% of DDP's loss). H is
measured at M = 2 (10, 30 and 100: 0.8 beat 0.6 at each, -0.8%, +0.2% and +7.7% of DDP); the
other M at H = 30 only. gpt-small's 2,000 steps (66 outer steps at H = 30) preferred a lower
momentum (0.4: +6.1%, 0.6: +2.8%, 0.8: +3.6%, 0.9: +8.5%): the table keeps the proxy's 0.8,
which costs the long run 0.8 points where 0.6 would cost the proxy 2.5 (docs/compression.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHOSEN = -1.0  # an outer setting left to the table ([Note: the outer learning rate])

# (kind, replicas M, inner steps H) -> (outer lr, outer momentum): each cell's best, measured.
# kind: the inner optimizer, "streamed" after it for Streaming DiLoCo (fragments or overlap)
MEASURED: dict[tuple[str, int, int], tuple[float, float]] = {
    ("adamw", 1, 30): (0.7, 0.9),
    ("adamw", 2, 10): (0.7, 0.8),
    ("adamw", 2, 30): (0.7, 0.8),
    ("adamw", 2, 100): (0.7, 0.8),
    ("adamw", 4, 30): (0.7, 0.8),
    ("adamw streamed", 2, 30): (0.7, 0.9),
    ("muon", 2, 30): (1.0, 0.6),
}
INNERS = ("adamw", "muon")


@dataclass(frozen=True)
class OuterSettings:
    """DiLoCo's outer Nesterov SGD for one run.

    lr: the outer learning rate.
    momentum: the outer Nesterov momentum (0: plain SGD).
    source: where they come from, for the job's and the planner's lines: "given", or the
        table's cell ("the table's for 2 replicas at H = 30 under AdamW").
    """

    lr: float
    momentum: float
    source: str

    def describe(self) -> str:
        return f"outer lr {self.lr:g}, momentum {self.momentum:g} ({self.source})"


def choose_outer(
    replicas: int,
    every: int,
    inner: str = "adamw",
    lr: float = CHOSEN,
    momentum: float = CHOSEN,
    streamed: bool = False,
) -> OuterSettings:
    """The outer settings of a DiLoCo run over `replicas` replicas every `every` inner steps
    under the `inner` optimizer ("adamw" or "muon"; any other takes AdamW's rows), `streamed`
    (fragments or overlap) or not: `lr` and `momentum` as given unless CHOSEN, else the
    nearest measured cell's (a streamed run without streamed cells of its optimizer takes its
    optimizer's plain ones)."""
    if lr != CHOSEN and momentum != CHOSEN:
        return OuterSettings(lr, momentum, "given")
    inner = inner if inner in INNERS else "adamw"
    kind = f"{inner} streamed" if streamed else inner
    key = nearest_cell(replicas, every, kind if any(k[0] == kind for k in MEASURED) else inner)
    table_lr, table_momentum = MEASURED[key]
    name = {"adamw": "AdamW", "muon": "Muon"}[inner] + (", streamed" if " " in key[0] else "")
    source = f"the table's for {key[1]} replica{'s' * (key[1] != 1)} at H = {key[2]} under {name}"
    if lr != CHOSEN or momentum != CHOSEN:
        source = f"{'lr' if lr != CHOSEN else 'momentum'} given, the rest {source}"
    return OuterSettings(
        table_lr if lr == CHOSEN else lr,
        table_momentum if momentum == CHOSEN else momentum,
        source,
    )


def nearest_cell(replicas: int, every: int, kind: str) -> tuple[str, int, int]:
    """The measured cell nearest to (replicas, every) of `kind` (AdamW's plain cells when it
    has none): the nearest M on a log scale first, then the nearest H (ties: the smaller)."""
    cells = [key for key in MEASURED if key[0] == kind] or [k for k in MEASURED if k[0] == "adamw"]

    def distance(key: tuple[str, int, int]) -> tuple[float, float, int, int]:
        return (
            abs(math.log(key[1]) - math.log(max(replicas, 1))),
            abs(math.log(key[2]) - math.log(max(every, 1))),
            key[1],
            key[2],
        )

    return min(cells, key=distance)

"""What this process's collectives have done: a count per group, and the ones a thread waits on.

[Note: collective progress] Every collective a `Comm` runs (and any other a caller wraps in
`watched`) takes the next sequence number of its process group: #1, #2, ... Every rank of a
group calls the group's collectives in the same order (the rule collectives follow), so #57 on
one rank is #57 on every other, and a rank whose count is below 57 has not yet arrived there.
While a thread is blocked on a collective (a synchronous call, or `wait()` on an asynchronous
one), the collective is listed in `Progress.waiting` with the moment the wait began. The
watchdog (watchdog.py) reads both from its own thread; the training thread pays one dict
update and one clock read per collective, and never talks to the store.

The counts are per process (one `Progress`, `PROGRESS`), not per `Comm`, because several Comms
share one group (two parallelized models, the trainer's own sums) and the numbering must follow
the group. It is the one module-level object of the comm layer: what it describes, the order of
one process's collectives on one group, is itself process-wide, as torch's own default group is.

[Note: checked collectives] With `Progress.check` on (`dp.init(check_collectives=True)`,
`--check-collectives`), each collective is preceded by an exchange of fingerprints on its group:
one all-gather of 16 int64 per rank (kind, sequence number, op, dtype, shape, element count).
On the first difference every rank raises the same `CollectiveMismatch`, naming the collective,
the first rank that differs from the group's first rank, and what differs. This is a debug mode:
it doubles the number of messages and waits for every rank before each collective.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
import torch.distributed as dist

# Append only: the codes travel between ranks in fingerprints.
KINDS = (
    "all_reduce",
    "broadcast",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "all_gather_object",
    "barrier",
    "broadcast_object",
)
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
# torch 2.13's name for it (the old one warns); older torch has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
FINGERPRINT = 16  # int64 per fingerprint
_MAX_DIMS = FINGERPRINT - 8  # dimensions recorded one by one; the element count covers the rest


class CollectiveMismatch(RuntimeError):
    """The ranks of a group called different collectives ([Note: checked collectives])."""


class Collective:
    """One collective of this process: its group, sequence number on it, kind and label.

    label: the tracer's label when it was launched (`{"bucket": 3}`, `{"unit": 2}`...; see
    `Tracer.labelled`), or {}.
    """

    __slots__ = ("group", "seq", "kind", "label")

    def __init__(self, group: str, seq: int, kind: str, label: dict):
        self.group, self.seq, self.kind, self.label = group, seq, kind, label

    def __repr__(self) -> str:
        return f"Collective({self.kind} #{self.seq} on group {self.group!r}, {self.label})"


class Progress:
    """This process's collectives ([Note: collective progress]).

    launched: group name -> collectives launched on it so far (the last sequence number).
    members: group name -> the global ranks of the group, in group-rank order.
    waiting: token -> (collective, time.monotonic() when the wait began), one per blocked wait.
    check: exchange fingerprints before each collective ([Note: checked collectives]).
    waited_s: thread id -> seconds that thread has spent blocked on collectives (the trainer
        subtracts its own from a step's time: [Note: blame] in train/blame.py).
    """

    def __init__(self):
        self.launched: dict[str, int] = {}
        self.members: dict[str, tuple[int, ...]] = {}
        self.waiting: dict[int, tuple[Collective, float]] = {}
        self.check = False
        self.waited_s: dict[int, float] = {}
        self._tokens = itertools.count()

    def register(self, group: dist.ProcessGroup) -> str:
        """The group's name (the same on every rank of it), noting its members the first time."""
        name = group.group_name
        if name not in self.members:
            self.members[name] = tuple(dist.get_process_group_ranks(group))
        return name

    def launch(self, group: str, kind: str, label: dict) -> Collective:
        """The next collective on `group` (a name from `register`)."""
        seq = self.launched.get(group, 0) + 1
        self.launched[group] = seq
        return Collective(group, seq, kind, label)

    def begin_wait(self, collective: Collective) -> int:
        """A thread starts waiting on `collective`; give the token to `end_wait`."""
        token = next(self._tokens)
        self.waiting[token] = (collective, time.monotonic())
        return token

    def end_wait(self, token: int) -> None:
        """The wait of `token` is over (called on the thread that began it)."""
        entry = self.waiting.pop(token, None)
        if entry is not None:
            thread = threading.get_ident()
            self.waited_s[thread] = self.waited_s.get(thread, 0.0) + time.monotonic() - entry[1]

    def waited(self) -> float:
        """Seconds the calling thread has spent blocked on collectives so far."""
        return self.waited_s.get(threading.get_ident(), 0.0)

    def oldest_wait(self) -> tuple[Collective, float] | None:
        """The collective waited on longest now, and when its wait began; None if none."""
        waits = list(self.waiting.values())  # one C-level copy: safe against the other thread
        return min(waits, key=lambda w: w[1]) if waits else None

    def reset(self) -> None:
        """Forget every group (after the process group is destroyed: names are reused)."""
        self.launched.clear()
        self.members.clear()
        self.waiting.clear()


PROGRESS = Progress()


def watched(group, kind: str, tensor: torch.Tensor | None = None, **label) -> _Watched:
    """`with watched(group, "barrier"):` numbers and watches a collective called directly on
    torch.distributed, outside any `Comm` ([Note: collective progress]), and checks it in the
    checked mode, where `tensor` is what its fingerprint describes. Extra keywords label it, like
    `Tracer.labelled` (`what="trainer sums"`)."""
    return _Watched(group if group is not None else dist.group.WORLD, kind, tensor, label)


class _Watched:
    def __init__(self, group, kind: str, tensor: torch.Tensor | None, label: dict):
        self.group, self.kind, self.tensor, self.label = group, kind, tensor, label
        self.token = -1

    def __enter__(self) -> Collective:
        progress = PROGRESS
        collective = progress.launch(progress.register(self.group), self.kind, self.label)
        if progress.check:
            check_collective(self.group, collective, self.tensor, progress=progress)
        self.token = progress.begin_wait(collective)
        return collective

    def __exit__(self, *exc) -> None:
        PROGRESS.end_wait(self.token)


def fingerprint(collective: Collective, tensor: torch.Tensor | None, how=None) -> list[int]:
    """The 16 numbers ranks compare ([Note: checked collectives]). `how`: a reduce op, or a
    broadcast's source rank; None for neither."""
    kind = KINDS.index(collective.kind) if collective.kind in KINDS else -1
    how = -1 if how is None else how if isinstance(how, int) else op_index(how)
    if tensor is None:
        return [kind, collective.seq, how, -1, -1] + [-1] * _MAX_DIMS + [0, 0, 0]
    shape = list(tensor.shape)
    dims = (shape + [-1] * _MAX_DIMS)[:_MAX_DIMS]
    dtype = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else -1
    return [kind, collective.seq, how, dtype, len(shape)] + dims + [tensor.numel(), 0, 0]


def op_index(op) -> int:
    """A ReduceOp's index in OPS (-1 if unknown)."""
    for index, name in enumerate(OPS):
        if op == getattr(dist.ReduceOp, name, None):
            return index
    return -1


def check_collective(
    group, collective: Collective, tensor: torch.Tensor | None, how=None, progress=None
) -> None:
    """Exchange fingerprints on `group` and raise `CollectiveMismatch` on every rank if they
    differ ([Note: checked collectives]). The exchange is watched as part of the collective."""
    progress = progress or PROGRESS
    members = progress.members[collective.group]
    if len(members) == 1:
        return
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(fingerprint(collective, tensor, how), dtype=torch.int64, device=device)
    everyone = torch.empty(len(members) * FINGERPRINT, dtype=torch.int64, device=device)
    token = progress.begin_wait(collective)
    try:
        _all_gather(everyone, mine, group=group)
    finally:
        progress.end_wait(token)
    rows = everyone.view(len(members), FINGERPRINT).tolist()
    message = mismatch_message(collective.seq, members, rows)
    if message is not None:
        raise CollectiveMismatch(message)


def mismatch_message(seq: int, members: tuple[int, ...], rows: list[list[int]]) -> str | None:
    """One line naming the first rank whose fingerprint differs from the group's first rank's,
    or None if all agree. `rows[i]` is group rank i's fingerprint; ranks are named globally."""
    first = rows[0]
    for member, row in zip(members[1:], rows[1:], strict=True):
        if row != first:
            theirs, ours = _describe_pair(row, first)
            return (
                f"collective mismatch: collective #{seq} on group of {len(members)} "
                f"(ranks {ranks_text(members)}): rank {member} called {theirs} while rank "
                f"{members[0]} called {ours}; every rank of a group must call the same "
                "collectives, with tensors of the same shape and dtype, in the same order"
            )
    return None


def _describe_pair(a: list[int], b: list[int]) -> tuple[str, str]:
    """How two fingerprints read, each with the sequence number and the op (or broadcast
    source) only where those differ."""
    show_seq, show_how = a[1] != b[1], a[2] != b[2]
    return _describe(a, show_seq, show_how), _describe(b, show_seq, show_how)


def _describe(row: list[int], show_seq: bool, show_how: bool) -> str:
    kind = KINDS[row[0]] if 0 <= row[0] < len(KINDS) else f"collective kind {row[0]}"
    text = kind + (f" #{row[1]}" if show_seq else "")
    if show_how and row[2] >= 0:
        if kind == "broadcast":
            text += f" from {row[2]}"
        elif row[2] < len(OPS):
            text += f" {OPS[row[2]].lower()}"
    ndim = row[4]
    if ndim < 0:
        return text
    dims = [str(d) for d in row[5 : 5 + min(ndim, _MAX_DIMS)]]
    if ndim > _MAX_DIMS:
        dims.append(f"... ({row[5 + _MAX_DIMS]} elements)")
    dtype = DTYPES[row[3]] if 0 <= row[3] < len(DTYPES) else None
    dtype_text = str(dtype).removeprefix("torch.") if dtype is not None else "other dtype"
    return f"{text} [{', '.join(dims)}] {dtype_text}"


def ranks_text(ranks) -> str:
    """Ranks as short text: consecutive runs joined ("0-3,6,8-9")."""
    ranks = sorted(ranks)
    parts: list[str] = []
    start = prev = None
    for rank in ranks + [None]:
        if start is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    return ",".join(parts)


def label_text(label: dict) -> str:
    """A tracer label as words: {"bucket": 3} -> "bucket 3", {"what": "parameters"} ->
    "parameters"."""
    return ", ".join(str(v) if k == "what" else f"{k} {v}" for k, v in label.items())

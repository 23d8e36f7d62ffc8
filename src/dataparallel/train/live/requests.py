"""Asking a live run's launcher, from outside it, to let a replica join or to let one leave.

    answer = ask(store, Request(kind=JOIN, pid=os.getpid(), host="node7"), key)  # dataparallel join
    answer = ask(store, Request(kind=LEAVE, replica=2), key)                     # dataparallel leave

    desk = Desk(store, Gate(key), say)                  # the launcher, every poll
    for number, request in desk.pending():
        desk.answer(number, Answer(ok=True, replica=3, message="..."))

[Note: membership requests] The launcher is the only decider of a live run ([Note: membership]
in membership.py), so a change of size that starts outside it is a request it answers: yes (a
joiner gets a fresh slot; a leaver's slot is marked) or no, with the reason, which the asking
command prints. Under the store's prefix (the keys are named in store.py):
    requests            a counter: a client takes the next number with add(1)...
    request/<n>         ...then writes its Request (JSON) there, sealed with the run's key
                        ([Note: signed requests] in secret.py): one that is not authentic
                        or fresh is answered no and said on one line in the launcher's log;
    answer/<n>          the launcher's Answer (JSON), written once;
    leave/<slot>        set by the launcher when it releases `slot`: the member reports LEAVE
                        at its next regroup, which the launcher asks of its generation;
    beat/<slot>         a joiner's heartbeat, a counter it adds to every HEARTBEAT_S (remote.py);
    signal/<slot>       a signal number the launcher asks a joiner to raise in itself;
    bye/<slot>          a joiner's exit status, written as it ends;
    run                 the resolved run (the workers' DATAPARALLEL_RUN), which a joiner trains,
                        sealed by the launcher (a joiner refuses one that does not verify).
A joiner is not the launcher's child: the launcher cannot wait for it or signal it, and its pid
may be on another machine. Its heartbeat tells the launcher that it lives, `signal/<slot>`
carries the launcher's SIGTERM or SIGKILL to it, and `bye/<slot>` its exit status back
(remote.py). A number taken by a client that died before writing its request is looked
at again on every poll, which costs one `check` and blocks nobody.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch.distributed as dist

from .membership import JOIN, LEAVE
from .secret import Gate, Refused, RunKey
from .store import COUNTER, answer_key, request_key


@dataclass(frozen=True, kw_only=True)
class Request:
    """A request to the launcher of a live run.

    kind: JOIN (a new replica, the asking process itself) or LEAVE (an existing one).
    replica: LEAVE: the slot that should leave; JOIN: unused (-1).
    pid: JOIN: the joiner's process id, for the launcher's messages.
    host: JOIN: the joiner's machine (its host name), for the launcher's messages.
    """

    kind: str
    replica: int = -1
    pid: int = 0
    host: str = ""

    def __post_init__(self):
        if self.kind not in (JOIN, LEAVE):
            raise ValueError(f"Request: kind={self.kind!r} must be {JOIN!r} or {LEAVE!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Request:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True)
class Answer:
    """The launcher's answer to a Request.

    ok: whether it is granted.
    message: what the asking command prints: what happens next, or why not and what to do.
    replica: JOIN granted: the joiner's slot; else -1.
    """

    ok: bool
    message: str
    replica: int = -1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Answer:
        return cls(**json.loads(text))


def ask(
    store: dist.Store,
    request: Request,
    key: RunKey | None = None,
    timeout_s: float = 60.0,
    poll_s: float = 0.05,
) -> Answer:
    """Send `request`, sealed with the run's `key` (None: unsealed, which a launcher refuses),
    to the launcher and wait for its answer (TimeoutError after `timeout_s`)."""
    number = store.add(COUNTER, 1)
    text = request.to_json()
    store.set(request_key(number), key.seal(text) if key is not None else text)
    key, deadline = answer_key(number), time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the launcher did not answer within {timeout_s:g} s")
        time.sleep(poll_s)
    return Answer.from_json(store.get(key))


class Desk:
    """The launcher's side: the requests not answered yet, in the order they were numbered.

    store: the store the launcher hosts (under the run's prefix).
    gate: what lets a request in ([Note: signed requests] in secret.py); None lets in any (the
        quorum's unit tests only: a launcher always has one).
    say: called with one line for each request refused (the launcher's log).
    """

    def __init__(
        self,
        store: dist.Store,
        gate: Gate | None = None,
        say: Callable[[str], None] = print,
    ):
        self.store, self.gate, self.say = store, gate, say
        self.counted = 0  # numbers taken so far
        self.unread: list[int] = []  # taken, but no request written yet

    def pending(self) -> list[tuple[int, Request]]:
        """The requests written since the last call, as (number, request)."""
        counted = self.store.add(COUNTER, 0)
        self.unread += range(self.counted + 1, counted + 1)
        self.counted = counted
        found = [n for n in self.unread if self.store.check([request_key(n)])]
        self.unread = [n for n in self.unread if n not in found]
        requests = []
        for n in found:  # anything that can reach the store can write here: never trust it
            text = self.store.get(request_key(n))
            try:
                body = self.gate.open(text) if self.gate is not None else text
            except Refused as refused:
                self.say(f"request {n} refused: {refused}; the run goes on")
                self.answer(n, Answer(ok=False, message=f"not authenticated ({refused.reason})"))
                continue
            try:
                requests.append((n, Request.from_json(body)))
            except (ValueError, TypeError, KeyError) as error:
                self.answer(n, Answer(ok=False, message=f"malformed request: {error}"))
        return requests

    def answer(self, number: int, answer: Answer) -> None:
        self.store.set(answer_key(number), answer.to_json())

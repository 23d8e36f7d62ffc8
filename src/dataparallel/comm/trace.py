"""What a trace records: instants (`mark`), and spans with a start and an end.

[Note: trace spans] Three tracks of spans, all in time.perf_counter_ns (one clock for every
process on a machine, so the ranks' traces line up):
- "compute": a phase of the training thread (the trainer's forward, backward, optimizer step),
  opened and closed with `Tracer.span`;
- "blocked": the training thread waiting on communication: a synchronous collective from its
  call to its return, or `wait()` on an asynchronous one (`TracedWork`). These nest inside the
  compute phases; the exposed communication of a step is their union;
- "comm": a collective in flight, from its launch to its completion, with its kind, bytes and
  label (the bucket or unit it reduces, `Tracer.labelled`). Completion is the moment the
  backend completes the Work's future (`args["end"] == "completed"`), or, for a Work without a
  future (gloo's reduce-scatter, our pairwise collectives, whose messages gloo completes only
  when waited for), the end of the first `wait()` (`"waited"`, an upper bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TraceEvent:
    """One instant in a trace: `name` at `t_ns` (time.perf_counter_ns), with free-form args."""

    name: str
    t_ns: int
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Span:
    """One interval of a trace ([Note: trace spans]).

    name: what ran: a phase ("forward"), a collective's kind ("all_reduce"), or "wait".
    track: "compute", "blocked" or "comm".
    start_ns: time.perf_counter_ns at its start.
    end_ns: time.perf_counter_ns at its end.
    args: details: a collective's `kind`, `bytes`, `end` and label (`bucket`, `unit`...).
    """

    name: str
    track: str
    start_ns: int
    end_ns: int
    args: dict = field(default_factory=dict)


class Tracer:
    """Records instants (`mark`) and spans while enabled; both lists keep recording order.

    Off by default; recording costs one list append per event. Work callbacks run on the
    communication thread, and list.append is atomic under the GIL, so no lock is needed.
    """

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.events: list[TraceEvent] = []
        self.spans: list[Span] = []
        self.label: dict = {}  # what the collectives launched now reduce (see `labelled`)

    def mark(self, name: str, **args) -> None:
        if self.enabled:
            self.events.append(TraceEvent(name, time.perf_counter_ns(), args))

    def span(self, name: str, track: str = "compute", **args) -> _Open:
        """`with tracer.span("forward"):` records the block as a span (nothing when disabled)."""
        return _Open(self, name, track, args)

    def labelled(self, **label) -> _Label:
        """`with tracer.labelled(bucket=3):` tags the collectives launched inside."""
        return _Label(self, label)

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def first(self, name: str, **match) -> TraceEvent | None:
        for event in self.events:
            if event.name == name and all(event.args.get(k) == v for k, v in match.items()):
                return event
        return None

    def clear(self) -> None:
        self.events.clear()
        self.spans.clear()

    def to_chrome(self, pid: int = 0) -> list[dict]:
        """The instants as Chrome-trace events (train/tracing.py writes spans and all)."""
        return [
            {"name": e.name, "ph": "i", "s": "p", "ts": e.t_ns / 1000, "pid": pid, "args": e.args}
            for e in self.events
        ]


class _Open:
    def __init__(self, tracer: Tracer, name: str, track: str, args: dict):
        self.tracer, self.name, self.track, self.args = tracer, name, track, args
        self.start = 0

    def __enter__(self) -> _Open:
        self.start = time.perf_counter_ns() if self.tracer.enabled else 0
        return self

    def __exit__(self, *exc) -> None:
        if self.start and self.tracer.enabled:
            span = Span(self.name, self.track, self.start, time.perf_counter_ns(), self.args)
            self.tracer.add(span)


class _Label:
    def __init__(self, tracer: Tracer, label: dict):
        self.tracer, self.label, self.saved = tracer, label, {}

    def __enter__(self) -> None:
        self.saved, self.tracer.label = self.tracer.label, self.label

    def __exit__(self, *exc) -> None:
        self.tracer.label = self.saved


class TracedWork:
    """An asynchronous collective's Work that records, while its tracer is enabled, the
    training thread's waits ("blocked") and, if launched while enabled, the collective's span
    ("comm") when it completes ([Note: trace spans]). Its `wait()` is listed in `progress` as
    a wait on `collective`, for the watchdog ([Note: collective progress] in progress.py).
    Anything else goes to the Work itself."""

    def __init__(
        self,
        work,
        tracer: Tracer,
        kind: str,
        args: dict | None,
        start_ns: int,
        collective=None,
        progress=None,
    ):
        self.work, self.tracer, self.kind = work, tracer, kind
        self.args, self.start_ns = args or {}, start_ns
        self.collective, self.progress = collective, progress
        self.open = args is not None  # launched while enabled: its span is still to record
        self.future = None
        if self.open:
            try:
                self.future = work.get_future()
            except (AttributeError, RuntimeError):  # "Work::getFuture not implemented"
                self.future = None
            if self.future is not None:
                self.future.then(self._completed)

    def _completed(self, _future) -> None:
        self._end(time.perf_counter_ns(), "completed")

    def _end(self, end_ns: int, how: str) -> None:
        if self.open:
            self.open = False
            span = Span(self.kind, "comm", self.start_ns, end_ns, {**self.args, "end": how})
            self.tracer.add(span)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *args):
        start = time.perf_counter_ns()
        if self.progress is None:
            result = self.work.wait(*args)
        else:
            token = self.progress.begin_wait(self.collective)
            try:
                result = self.work.wait(*args)
            finally:
                self.progress.end_wait(token)
        end = time.perf_counter_ns()
        if self.tracer.enabled:
            args = {"kind": self.kind, **self.args}
            self.tracer.add(Span("wait", "blocked", start, end, args))
        if self.future is None:
            self._end(end, "waited")
        return result

    def __getattr__(self, name: str):
        return getattr(self.work, name)

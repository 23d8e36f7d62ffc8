"""Traces (--trace): spans, collectives' works, the Chrome file, and what the report reads from it.

A traced 2-rank run (collectives, bytes against the metrics) is in tests/e2e/test_train_cli.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from dataparallel.comm import Span, Tracer
from dataparallel.comm.trace import TracedWork
from dataparallel.train.trace_report import step_breakdown
from dataparallel.train.tracing import chrome_trace, parse_steps


def test_steps_parse_as_a_range_or_one_step():
    assert parse_steps("10-12") == (10, 12)
    assert parse_steps("5") == (5, 5)
    assert parse_steps(" 3-3 ") == (3, 3)
    for bad in ["", "a", "3-", "-3", "4-2", "0-2", "1-2-3", "2.5"]:
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_spans_are_recorded_only_while_enabled_and_collectives_take_the_label():
    tracer = Tracer()
    with tracer.span("forward"):
        pass
    assert tracer.spans == []
    tracer.enabled = True
    with tracer.labelled(bucket=3):
        assert tracer.label == {"bucket": 3}
        with tracer.labelled(unit=1):
            assert tracer.label == {"unit": 1}
        assert tracer.label == {"bucket": 3}
    assert tracer.label == {}
    with tracer.span("backward", micro=1):
        pass
    (span,) = tracer.spans
    assert (span.name, span.track, span.args) == ("backward", "compute", {"micro": 1})
    assert span.end_ns >= span.start_ns


class _Work:
    """A Work without a future (gloo's reduce-scatter, our pairwise collectives)."""

    def __init__(self):
        self.waited = 0

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self):
        self.waited += 1
        return True

    def is_completed(self):
        return self.waited > 0


class _FutureWork(_Work):
    def __init__(self):
        super().__init__()
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


def test_a_work_without_a_future_ends_when_waited_for():
    tracer = Tracer(enabled=True)
    work = TracedWork(_Work(), tracer, "reduce_scatter", {"bytes": 64, "unit": 2}, 1)
    assert not work.is_completed() and tracer.spans == []
    work.wait()
    work.wait()  # a second wait records another (short) wait, not a second collective
    comm = [s for s in tracer.spans if s.track == "comm"]
    assert len(comm) == 1 and comm[0].args == {"bytes": 64, "unit": 2, "end": "waited"}
    blocked = [s for s in tracer.spans if s.track == "blocked"]
    assert len(blocked) == 2 and blocked[0].args == {
        "kind": "reduce_scatter",
        "bytes": 64,
        "unit": 2,
    }


def test_a_work_with_a_future_ends_when_it_completes_not_when_waited_for():
    tracer = Tracer(enabled=True)
    inner = _FutureWork()
    work = TracedWork(inner, tracer, "all_reduce", {"bytes": 8}, 1)
    inner.future.set_result(None)  # the backend completes it ...
    (comm,) = tracer.spans
    assert comm.track == "comm" and comm.args["end"] == "completed"
    work.wait()  # ... and the training thread only waits later
    assert [s.track for s in tracer.spans] == ["comm", "blocked"]
    assert tracer.spans[1].start_ns >= comm.end_ns


def test_a_work_launched_while_disabled_records_only_later_waits():
    tracer = Tracer()
    work = TracedWork(_FutureWork(), tracer, "all_gather", None, 0)
    tracer.enabled = True  # a gather launched in the step before the traced ones
    work.wait()
    assert [(s.name, s.track) for s in tracer.spans] == [("wait", "blocked")]


def _span(name, track, start, end, **args) -> Span:
    return Span(name, track, start * 1000, end * 1000, args)  # microseconds -> ns


def test_the_chrome_trace_puts_overlapping_collectives_on_separate_tids():
    tracer = Tracer()
    tracer.spans += [
        _span("step", "step", 0, 100, step=4),
        _span("backward", "compute", 0, 80),
        _span("all_reduce", "comm", 10, 50, bytes=100, bucket=0),
        _span("all_reduce", "comm", 20, 60, bytes=50, bucket=1),
        _span("all_reduce", "comm", 55, 70, bytes=8),
    ]
    trace = json.loads(json.dumps(chrome_trace(tracer, rank=1, steps=(4, 4))))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        ("step", 0, 0.0, 100.0),  # the parent first at equal ts
        ("backward", 0, 0.0, 80.0),
        ("all_reduce", 1, 10.0, 40.0),
        ("all_reduce", 2, 20.0, 40.0),
        ("all_reduce", 1, 55.0, 15.0),  # lane 1 is free again after 50
    ]
    assert all(e["pid"] == 1 for e in trace["traceEvents"])
    threads = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and "tid" in e
    }
    assert threads == {0: "training thread", 1: "collectives 1", 2: "collectives 2"}


def test_exposed_communication_is_the_union_of_the_waits():
    tracer = Tracer()
    tracer.spans += [
        _span("step", "step", 0, 100, step=2),
        _span("forward", "compute", 0, 30),
        _span("backward", "compute", 30, 90),
        _span("wait", "blocked", 70, 85, kind="all_reduce"),
        _span("wait", "blocked", 80, 90, kind="all_reduce"),  # overlaps the first: 70..90
        _span("optimizer", "compute", 90, 98),
        _span("all_reduce", "comm", 40, 88, bytes=100),
        _span("all_reduce", "comm", 60, 90, bytes=28),
        _span("all_reduce", "comm", 150, 160, bytes=1),  # after the step: not counted
    ]
    events = [e for e in chrome_trace(tracer, 0, (2, 2))["traceEvents"] if e["ph"] == "X"]
    (row,) = step_breakdown(events)
    assert row["step"] == 2 and row["wall_us"] == 100
    assert row["phases_us"] == 98 and row["coverage"] == pytest.approx(0.98)
    assert row["exposed_comm_us"] == 20 and row["exposed_comm_fraction"] == pytest.approx(0.2)
    assert row["comm_in_flight_us"] == 50 and row["comm_bytes"] == 128

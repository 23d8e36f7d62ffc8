"""A live run's secret and its sealed requests ([Note: signed requests] in train/live/secret.py):
each way a request can fail to be authentic or fresh is refused, and counted by its reason."""

from __future__ import annotations

import json
import stat

import pytest
import torch.distributed as dist

from dataparallel.train.config import ConfigError
from dataparallel.train.live.membership import JOIN, LEAVE, Report
from dataparallel.train.live.quorum import Quorum, QuorumHost
from dataparallel.train.live.requests import Answer, Desk, Request
from dataparallel.train.live.secret import (
    SECRET_FILE,
    Gate,
    Refused,
    RunKey,
    find_secret,
    make_secret,
)
from dataparallel.train.live.store import COUNTER, HostedStore, answer_key, request_key

KEY, OTHER = RunKey(b"k" * 32), RunKey(b"o" * 32)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_secret_file_is_its_owners_only(tmp_path, monkeypatch):
    path = make_secret(tmp_path)
    assert path == tmp_path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) == 64 and make_secret(tmp_path).read_text() != ""
    monkeypatch.delenv("DATAPARALLEL_SECRET_FILE", raising=False)
    assert find_secret(tmp_path) == path
    monkeypatch.setenv("DATAPARALLEL_SECRET_FILE", "/mounted/secret")
    assert str(find_secret(tmp_path)) == "/mounted/secret"
    assert str(find_secret(tmp_path, "/given")) == "/given"
    assert RunKey.read(path).secret == path.read_text().strip().encode()
    with pytest.raises(ConfigError, match="--secret-file.*cannot read"):
        RunKey.read(tmp_path / "none")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError, match="holds 3 characters"):
        RunKey.read(tmp_path / "short")


def test_each_bad_request_is_refused_and_counted():
    clock = Clock()
    gate = Gate(KEY, valid_s=60.0, clock=clock)
    good = KEY.seal('{"kind": "join"}', now=clock.now)
    assert gate.open(good) == '{"kind": "join"}'
    altered = json.loads(KEY.seal('{"kind": "join"}', now=clock.now))
    altered["body"] = '{"kind": "leave", "replica": 0}'
    cases = {
        "unsigned": [
            '{"kind": "join"}',
            "not json",
            json.dumps({"body": "x", "nonce": 1, "time": 0, "mac": ""}),
        ],
        "forged": [OTHER.seal('{"kind": "join"}', now=clock.now), json.dumps(altered)],
        "expired": [
            KEY.seal('{"kind": "join"}', now=clock.now - 61),
            KEY.seal('{"kind": "join"}', now=clock.now + 61),
        ],
        "replayed": [good],
    }
    for reason, texts in cases.items():
        for text in texts:
            with pytest.raises(Refused, match=f"^{reason}: ") as refused:
                gate.open(text)
            assert refused.value.reason == reason
    assert dict(gate.refused) == {"unsigned": 3, "forged": 2, "expired": 2, "replayed": 1}
    assert sum(len(t) for t in cases.values()) == 8


def test_a_nonce_is_forgotten_once_its_time_no_longer_verifies():
    clock = Clock()
    gate = Gate(KEY, valid_s=60.0, clock=clock)
    for i in range(5):
        gate.open(KEY.seal(str(i), now=clock.now))
    assert len(gate.seen) == 5
    clock.now += 121
    gate.open(KEY.seal("later", now=clock.now))
    assert len(gate.seen) == 1  # the memory stays bounded


def test_a_report_verifies_only_under_its_own_key():
    text = KEY.seal(
        Report(replica=1, step=0, where=JOIN, pid=7).to_json(), purpose="gen/3/report/1"
    )
    assert json.loads(KEY.verify(text, purpose="gen/3/report/1")["body"])["where"] == JOIN
    with pytest.raises(Refused, match="forged"):
        KEY.verify(text, purpose="gen/4/report/1")


def test_the_desk_and_the_quorum_let_in_only_sealed_ones():
    store = dist.HashStore()
    said: list[str] = []
    desk, host = Desk(store, Gate(KEY), said.append), QuorumHost(store, 3, KEY, said.append)
    for text in (Request(kind=JOIN, pid=5).to_json(), OTHER.seal(Request(kind=JOIN).to_json())):
        store.set(request_key(store.add(COUNTER, 1)), text)
    good = KEY.seal(Request(kind=LEAVE, replica=2).to_json())
    for _ in range(2):  # the second one is a replay of the first
        store.set(request_key(store.add(COUNTER, 1)), good)
    pending = desk.pending()
    assert [(n, r.kind, r.replica) for n, r in pending] == [(3, LEAVE, 2)]
    answers = [Answer.from_json(store.get(answer_key(n))) for n in (1, 2, 4)]
    assert [a.message for a in answers] == [
        "not authenticated (unsigned)",
        "not authenticated (forged)",
        "not authenticated (replayed)",
    ]
    assert [line.split(":")[0] for line in said] == [
        "request 1 refused",
        "request 2 refused",
        "request 4 refused",
    ]
    Quorum(store, 0, key=KEY).report(5, Report(replica=0, step=9))
    Quorum(store, 1, key=OTHER).report(5, Report(replica=1, step=0, where=JOIN))
    Quorum(store, 2).report(5, Report(replica=2, step=0, where=JOIN))
    for _ in range(3):  # read on every poll, said once
        assert list(host.reports(5)) == [0]
    assert len(said) == 5 and "gen/5/report/1 refused: forged" in said[3]


def test_the_store_listens_on_the_run_address_only():
    hosted = HostedStore("127.0.0.1")
    assert hosted.address == f"127.0.0.1:{hosted.port}"
    assert hosted.listener.getsockname() == ("127.0.0.1", hosted.port)
    hosted.store.set("a", "1")
    with pytest.raises(ConfigError, match="--store-host.*cannot listen on 192.0.2.1"):
        HostedStore("192.0.2.1")


def test_a_joiner_trains_only_the_run_the_launcher_sealed(tmp_path):
    from dataparallel.train.live.elastic import read_run
    from dataparallel.train.live.store import RUN_KEY

    path = make_secret(tmp_path)
    key, store = RunKey.read(path), dist.HashStore()
    store.set(RUN_KEY, key.seal('{"run": 1}', purpose=RUN_KEY))
    assert read_run(store, path) == '{"run": 1}'
    for written, reason in [
        ('{"run": 2}', "unsigned"),
        (OTHER.seal('{"run": 2}', purpose=RUN_KEY), "forged"),
        (key.seal('{"run": 2}'), "forged"),  # sealed for another purpose (a request)
    ]:
        store.set(RUN_KEY, written)
        with pytest.raises(Refused, match=f"^{reason}"):
            read_run(store, path)

"""A live run lets in only requests sealed with its secret (docs/security.md): a join with no
secret, with a wrong one, and a replay of a recorded valid request are refused with one line
each in the launcher's log, and the run goes on to the weights it has without them."""

from __future__ import annotations

import subprocess
import time

from safetensors.torch import load_file

from dataparallel.cli import main
from dataparallel.train.live.membership import JOIN, LEAVE
from dataparallel.train.live.requests import Answer, Request, ask
from dataparallel.train.live.secret import RunKey
from dataparallel.train.live.store import (
    COUNTER,
    answer_key,
    client_store,
    read_run_file,
    request_key,
    run_store,
)

from .helpers import (
    CORPUS,
    GENERATION,
    LIVE_ARGS,
    LIVE_STEPS,
    WarmPopen,
    numbers,
    ok,
    told_on_failure,
    train_steps,
    wait_for,
)


def _send(store, text: str) -> Answer:
    """Write `text` as the next request, as any client of the store can, and wait for the
    launcher's answer."""
    number = store.add(COUNTER, 1)
    store.set(request_key(number), text)
    deadline = time.monotonic() + 60
    while not store.check([answer_key(number)]):
        assert time.monotonic() < deadline, f"no answer to request {number}"
        time.sleep(0.05)
    return Answer.from_json(store.get(answer_key(number)))


def test_unauthenticated_forged_and_replayed_requests_are_refused(tmp_path, capsys, live_reference):
    out, wrong = tmp_path / "live", tmp_path / "wrong.secret"
    wrong.write_text("0" * 64 + "\n")
    command = ["train", "--data", str(CORPUS), *LIVE_ARGS]
    command += ["--nproc", "2", "--batch", "6", "--min-replicas", "2", "--max-replicas", "3"]
    command += ["--recovery", "live", "--collective-timeout", "10", "--out", str(out)]
    launcher = WarmPopen(command)
    with told_on_failure(launcher):
        wait_for(lambda: any(s >= 3 for s in train_steps(out)), launcher, "step 3")
        address = read_run_file(out)
        assert address.startswith("127.0.0.1:")  # the run's address, not every interface
        store = run_store(client_store(address))
        # 1. No secret: an unsealed request, as a client that has none writes it.
        unsigned = ask(store, Request(kind=JOIN, pid=1, host="intruder"), key=None)
        # 2. A wrong secret, through the command itself.
        assert main(["join", str(out), "--secret-file", str(wrong)]) == 1
        # 3. A valid request (sealed with the run's key, refused on its merits: --min-replicas
        # 2), recorded and written again.
        recorded = RunKey.read(out / "live.secret").seal(Request(kind=LEAVE, replica=1).to_json())
        first, again = _send(store, recorded), _send(store, recorded)
        stdout, stderr = launcher.communicate(timeout=300)
    ok(subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr))
    said = capsys.readouterr()
    assert (unsigned.ok, unsigned.message) == (False, "not authenticated (unsigned)")
    assert "dataparallel join: refused: not authenticated (forged)" in said.err
    assert (first.ok, again.ok) == (False, False)
    assert "fewer than --min-replicas 2" in first.message
    assert again.message == "not authenticated (replayed)"
    refusals = [
        line for line in stderr.splitlines() if "dataparallel train: live: request " in line
    ]
    reasons = [line.split(" refused: ")[1].split(":")[0] for line in refusals]
    assert reasons == ["unsigned", "forged", "replayed"], stderr
    assert all(line.endswith("; the run goes on") for line in refusals)
    assert "replica 1 asked to leave: refused: 1 replica(s) would stay" in stderr
    # Nobody got in or out: one generation of the two started replicas, every step once.
    members = [numbers(m.group(2)) for m in GENERATION.finditer(stderr)]
    assert members == [[0, 1]], stderr
    assert train_steps(out) == list(range(1, LIVE_STEPS + 1))
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(live_reference / "model.safetensors"))
    difference = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    print(f"max |refused requests - uninterrupted| = {difference:.2e}")
    assert difference < 1e-4, difference  # 2 ranks against 1: the summation order only

"""What the end-to-end tests share, in one module (no test module imports another): the corpus,
the `dataparallel train` runner and a run's loss curve, the arguments of the live runs, the
live run with a worker killed and the readers of its records, and the warm joiner.

`make_reference_curve.py` regenerates the stored curve from REFERENCE_ARGS with `train` and
`curve`; the fixtures that train a shared reference once are in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from dataparallel.train.metrics import read_metrics

HERE = Path(__file__).parent
CORPUS = HERE / "data" / "corpus"
REFERENCE = HERE / "data" / "reference_curve.json"
# Every e2e run's world: 2 ranks of one thread each, 32-token windows; TINY is that world with
# gpt-tiny at 4 windows a rank, the short runs' model, in the order the stored reference curve's
# arguments were written in (REFERENCE_ARGS starts with it).
TWO_RANKS = ["--nproc", "2", "--threads", "1", "--block-size", "32"]
TINY = [
    "--nproc", "2",
    "--threads", "1",
    "--model", "gpt-tiny",
    "--block-size", "32",
    "--batch", "4",
]  # fmt: skip
# Small enough to run in seconds on 2 cores, large enough to exercise accumulation, clipping,
# warm-up, periodic validation over a set that does not divide by 2 (7 windows) and checkpoints.
REFERENCE_ARGS = [
    *TINY,
    "--accum", "2",
    "--steps", "12",
    "--lr", "3e-3",
    "--warmup-steps", "3",
    "--val-fraction", "0.1",
    "--eval-every", "6",
    "--eval-windows", "7",
    "--checkpoint-every", "6",
    "--seed", "1",
]  # fmt: skip

sys.path.insert(0, str(HERE.resolve().parent))  # tests/, also when make_reference_curve runs
from warm_processes import WarmPopen, run_cli  # noqa: E402
from worker_pids import live_workers, process_name  # noqa: E402


def cli(args: list[str], *, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """`dataparallel ARGS` in a process of its own, its output captured, without the
    interpreter's start (tests/warm_processes.py run_cli)."""
    return run_cli(args, timeout=timeout, env=env)


def train(args: list[str], out: Path, *, data: Path | None = None) -> subprocess.CompletedProcess:
    """Run `dataparallel train` in a process of its own (as a user would; forked warm, cli) and
    return the result. The data: `data`, else a copy of the corpus beside `out`."""
    data = data or corpus_copy(out.parent)
    return cli(["train", "--data", str(data), *args, "--out", str(out)])


def corpus_copy(folder: Path) -> Path:
    """folder/corpus, a copy of CORPUS (made once) for a run that may tokenize it: an hf: model's
    run writes its token cache beside the data ([Note: token cache] in data/cache.py), which
    must be a test's temporary folder, never the source tree (issue 43)."""
    copy = folder / "corpus"
    if not copy.is_dir():
        shutil.copytree(CORPUS, copy, ignore=shutil.ignore_patterns(".*"))
    return copy


def curve(run_dir: Path) -> dict:
    """The train and validation losses of a run, by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {
        "train_loss": {r["step"]: r["loss"] for r in records if r["kind"] == "train"},
        "val_loss": {r["step"]: r["val_loss"] for r in records if r["kind"] == "val"},
    }


def ok(result) -> None:
    """A finished command's status is 0 (its output in the failure's message)."""
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


# -- the live runs (docs/faults.md, "Live recovery") -------------------------------------------
LIVE_STEPS = 100
# A global batch of 12 windows and a small lr: a run without loss spikes, so that the summation
# order's rounding is not amplified (at lr 3e-3 a spike at step 20 turned 1e-7 into 5e-2).
LIVE_ARGS = [
    "--threads", "1",
    "--model", "gpt-tiny",
    "--block-size", "32",
    "--accum", "1",
    "--steps", str(LIVE_STEPS),
    "--lr", "3e-4",
    "--warmup-steps", "3",
    "--val-fraction", "0.1",
    "--eval-every", "25",
    "--eval-windows", "7",
    "--checkpoint-every", "0",
    "--log-every", "25",
    "--seed", "1",
]  # fmt: skip
GENERATION = re.compile(
    r"generation (\d+): workers \[([\d, ]+)\] \(pids ([\d, ]+)\) at step (\d+)(?:, healed \[([\d, ]+)\])?"
)


def numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def train_steps(run: Path) -> list[int]:
    """The steps in the run's metrics.jsonl so far (a line being written is not read)."""
    return [r["step"] for r in read_metrics(run) if r["kind"] == "train"]


def kill_during_a_live_run(out: Path, slot: int, args=LIVE_ARGS) -> tuple[dict, str, str]:
    """A live run on 3 workers (`args`, LIVE_ARGS unless given) whose worker in `slot` is killed
    with SIGKILL after step 3: ({slot: pid} before the kill, stdout, stderr); asserts status 0."""
    command = ["train", "--data", str(CORPUS), *args, "--nproc", "3", "--batch", "4"]
    command += ["--recovery", "live", "--collective-timeout", "10", "--out", str(out)]
    launcher = WarmPopen(command)
    with told_on_failure(launcher):
        wait_for(lambda: any(step >= 3 for step in train_steps(out)), launcher, "step 3")
        first = live_workers(launcher.pid)
        # forked from the launcher ([Note: forked workers] in launch/forked.py)
        assert {s: process_name(pid) for s, pid in first.items()} == {
            s: f"dp slot {s}.0" for s in range(3)
        }
        os.kill(first[slot], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=240)
    ok(subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr))
    return first, stdout, stderr


def check_generations(stderr: str, first: dict, slot: int) -> str:
    """The survivors stay the same processes in every generation, and a new process in `slot`
    joins them at a step boundary, healed from them; the step it joined at."""
    generations = [m.groups() for m in GENERATION.finditer(stderr)]
    assert generations, stderr
    survivors = {s: pid for s, pid in first.items() if s != slot}
    for _, members, pids, _, _ in generations:  # the survivors go on as the same processes
        slots = dict(zip(numbers(members), numbers(pids), strict=True))
        assert {s: slots[s] for s in survivors} == survivors, stderr
    # (Usually the survivors first train alone; if one of them is blocked on the other until
    # the collective timeout, the replacement may arrive in time for generation 1.)
    _, members, pids, joined_at, healed = next(g for g in generations if g[4])
    assert numbers(members) == [0, 1, 2] and numbers(healed) == [slot], stderr
    assert numbers(pids)[slot] not in first.values()
    assert 3 <= int(joined_at) < LIVE_STEPS
    return joined_at


def max_difference(out: Path, reference: Path) -> float:
    """The largest |difference| between two runs' final weights."""
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(reference / "model.safetensors"))
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


# -- membership changes (docs/faults.md, "Membership changes") ---------------------------------
# A joiner with torch already imported that asks to join once `go` exists: the test decides
# when it joins, not the time this machine takes to import torch.
WARM_JOINER = """
import pathlib, sys, time
from dataparallel.cli import main
from dataparallel.train.metrics import read_metrics
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
sys.exit(main(["join", sys.argv[2]]))
"""


def ranks_per_step(run: Path) -> list[int]:
    """The number of ranks of every step in metrics.jsonl so far, in order (a line being
    written is not read)."""
    return [len(r["rank_step_s"]) for r in read_metrics(run) if r["kind"] == "train"]


def start_warm(space: str, argv: list[str], env: dict[str, str]) -> WarmPopen:
    """host_namespaces' `start` for the suite: `argv`, a `python -m dataparallel.cli` command
    (after `env NAME=VALUE ...`, as a scheduler's variables are given), forked from the warm
    server into the network namespace `space` instead of started fresh by `ip netns exec`."""
    env, argv = dict(env), list(argv)
    if argv[0] == "env":
        argv.pop(0)
        while "=" in argv[0]:
            name, value = argv.pop(0).split("=", 1)
            env[name] = value
    assert argv[:3] == [sys.executable, "-m", "dataparallel.cli"], argv
    return WarmPopen(argv[3:], env=env, netns=space)


@contextlib.contextmanager
def told_on_failure(launcher: subprocess.Popen | WarmPopen):
    """The block drives the running `launcher`; when it fails (a wait in vain, an assertion, a
    timeout) the launcher is killed and the failure carries the end of what the run printed
    on stderr, so that a CI log says where the run stood, not only that a wait ran out."""
    try:
        yield
    except Exception as error:
        if launcher.poll() is None:
            launcher.kill()
        try:
            _, stderr = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a worker still holds the pipe
            stderr = "(not read: a worker still holds the pipe)"
        tail = (stderr or "")[-4000:]
        raise AssertionError(f"{error}\n--- the run's stderr, its end ---\n{tail}") from error
    finally:
        if launcher.poll() is None:
            launcher.kill()


def wait_for(
    condition, process: subprocess.Popen | WarmPopen, what: str, timeout_s: float = 120
) -> None:
    """Poll `condition` until it holds; fails if `process` ends first or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the launcher ended (status {process.returncode}) {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


# -- the trackers (docs/train.md, "--report-to") ------------------------------------------------
def tracker_env(folder: Path) -> dict[str, str]:
    """The environment of a run reporting to W&B and MLflow without the network: W&B offline,
    its settings and cache under `folder`, MLflow's default store (RUN/mlruns)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(folder / "wandb-config"),
        WANDB_CACHE_DIR=str(folder / "wandb-cache"),
        WANDB_DATA_DIR=str(folder / "wandb-data"),
    )
    return env


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (run-<id>.wandb): a LevelDB log after a 7-byte
    header (":W&B", magic, version), in 32 KiB blocks of chunks, each with a 7-byte header
    (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last); wandb 0.31 has no Python reader."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, block, parts = 7, 32768, b""
    while position + 7 <= len(data):
        room = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if room < 7 or (kind == 0 and length == 0):  # a block's zero padding
            position += room
            continue
        parts += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_sessions(run_dir: Path) -> list[dict]:
    """Each W&B session of a run, in order (one per start and resume): {"id", "name",
    "config": {key: value}, "history": [{key: value, ...} by step]}; an image is its dict."""
    sessions = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        session = {"history": [], "config": {}, "folder": folder}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session.update(id=record.run.run_id, name=record.run.display_name)
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            elif kind == "history":
                row: dict = {}
                for item in record.history.item:
                    keys = [item.key] if item.key else list(item.nested_key)
                    target = row
                    for key in keys[:-1]:
                        target = target.setdefault(key, {})
                    target[keys[-1]] = json.loads(item.value_json)
                session["history"].append(row)
                continue
            else:
                continue
            session["config"].update({u.key: json.loads(u.value_json) for u in updates})
        sessions.append(session)
    return sessions


def refused_in_one_line(args: list[str], folder: Path, capsys, fragments) -> None:
    """`dataparallel train ARGS` exits 2 with one error line holding every fragment, and
    writes nothing under `folder`."""
    from dataparallel.cli import main

    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dataparallel train: error: "), err
    assert len(fragments) >= 1
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before

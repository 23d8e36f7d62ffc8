"""`dataparallel join` and `dataparallel leave`: a live run grows or shrinks while it trains.

    dataparallel train --recovery live --nproc 2 --max-replicas 4 --out runs/big &
    dataparallel join runs/big                   # one more replica, from this process
    dataparallel leave runs/big --replica 1      # replica 1 leaves at its next step boundary

Both find the launcher's store in RUN_DIR/live.json (written by the launcher while it runs)
and ask it ([Note: membership requests] in requests.py); the launcher answers within
--min-replicas and --max-replicas ([Note: membership] in membership.py). A joiner that is
let in takes the next unused slot, trains the run's own config (read from the store), builds
its state alone and is healed from a member at their next step boundary, as a replacement is
([Note: live recovery] in recovery.py); it then trains in this process until the run ends, or
until it is asked to leave. Exit status: 0 done (or left), 1 refused or failed, 2 bad input.
Each request is sealed with the run's secret (RUN_DIR/live.secret, or --secret-file, or the
file named by DATAPARALLEL_SECRET_FILE: [Note: signed requests] in secret.py).
`--restarts K` keeps a replica on this machine: a lost one joins again ([Note: the machine's
keeper] in `keep`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ...launch.command import add_command, refused
from ..config import ConfigError
from .membership import JOIN, LEAVE
from .remote import Heartbeat
from .requests import Answer, Request, ask
from .secret import ENV_SECRET_FILE, SECRET_FILE, Refused, RunKey, find_secret
from .store import ENV_LIVE, RUN_FILE, RUN_KEY, client_store, read_run_file, run_store

CONNECT_TIMEOUT_S = 10.0
REFUSED = 3  # a join the launcher refused (a keeper's child; the command says 1)
REJOIN_WAIT_S = 30.0  # after a loss, how long a keeper asks again when a join is refused


def _live_run_parser(commands, name: str, run) -> argparse.ArgumentParser:
    """The parser of `join` or `leave`: the run's directory and the file of its secret."""
    parser = add_command(commands, name, run)
    parser.add_argument("run", metavar="RUN_DIR", help=f"the run's directory (holds {RUN_FILE})")
    parser.add_argument(
        "--secret-file",
        default=None,
        help=f"the file that holds the run's secret (default: ${ENV_SECRET_FILE}, else "
        f"RUN_DIR/{SECRET_FILE}, which the launcher writes readable by its user only)",
    )
    return parser


def add_join_parser(commands) -> None:
    parser = _live_run_parser(commands, "join", cmd_join)
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="when this machine's replica is lost after it joined (killed, crashed, left out "
        "as stalled), join again from here, up to this many times (0: never) ([Note: the "
        "machine's keeper])",
    )


def add_leave_parser(commands) -> None:
    parser = _live_run_parser(commands, "leave", cmd_leave)
    parser.add_argument(
        "--replica",
        type=int,
        required=True,
        help="the slot of the replica that leaves (the launcher's lines name them: workers [...])",
    )


def connect(run_dir: Path):
    """(address, the launcher's store under the run's prefix), or ConfigError."""
    address = read_run_file(run_dir)
    try:
        store = client_store(address, timeout_s=CONNECT_TIMEOUT_S)
    except RuntimeError:  # DistNetworkError, DistStoreError
        raise ConfigError(
            "RUN_DIR",
            f"no launcher answers at {address} (from {run_dir / RUN_FILE})",
            "check that the run still goes on (a launcher killed with -9 leaves the file)",
        ) from None
    return address, run_store(store)


def use_secret(run_dir: Path, given: str | None) -> Path:
    """The file of the run's key, from --secret-file, $DATAPARALLEL_SECRET_FILE or
    RUN_DIR/live.secret, checked readable (ConfigError naming the file); passed down to this
    process's replica (and a keeper's later ones), never left in the environment."""
    path = find_secret(run_dir, given).resolve()
    RunKey.read(path)
    return path


def read_run(store, secret: Path) -> str:
    """The run a joiner trains, as the launcher sealed it (Refused if anyone else wrote it)."""
    key = RunKey.read(secret)
    return key.verify(store.get(RUN_KEY), purpose=RUN_KEY)["body"]


def _answer(command: str, store, request: Request, secret: Path) -> Answer | None:
    """The launcher's answer, or None when it gave none (said on one line)."""
    try:
        return ask(store, request, RunKey.read(secret))
    except TimeoutError as error:
        print(f"dataparallel {command}: error: {error}", file=sys.stderr)
    except RuntimeError:  # the store closed: the launcher has ended
        print(f"dataparallel {command}: error: the run ended before answering", file=sys.stderr)
    return None


def cmd_join(args: argparse.Namespace) -> int:
    """add a replica to a running `dataparallel train --recovery live`

    Join the live run in RUN_DIR as one more replica (up to its --max-replicas): this process
    trains with the others until the run ends. Its state is received from them over the
    network; the run directory is where it writes its part of the checkpoints. In a run with
    --shard-group S, a replica is S processes: this one forks them.
    """
    if args.restarts < 0:
        error = ConfigError("--restarts", f"{args.restarts} is negative", "give 0 or more")
        return refused("join", error)
    try:
        secret = use_secret(Path(args.run), args.secret_file)
    except ConfigError as error:
        return refused("join", error)
    if args.restarts:
        return keep(Path(args.run), args.restarts, secret)
    code = join(Path(args.run), secret)
    return 1 if code == REFUSED else code


def join(run_dir: Path, secret: Path) -> int:
    """Join the run and train until it ends: 0 done or left, 1 failed, 2 bad input, REFUSED."""
    try:
        address, store = connect(run_dir)
    except ConfigError as error:
        return refused("join", error)
    request = Request(kind=JOIN, pid=os.getpid(), host=socket.gethostname())
    answer = _answer("join", store, request, secret)
    if answer is None:
        return 1
    if not answer.ok:
        print(f"dataparallel join: refused: {answer.message}", file=sys.stderr)
        return REFUSED
    print(f"dataparallel join: {answer.message}", file=sys.stderr, flush=True)
    from ..handoff import decode_run

    try:
        shard = decode_run(read_run(store, secret))[0].layout.shard  # processes per replica
    except Refused as forged:  # someone but the launcher wrote the run: train nothing of it
        print(f"dataparallel join: error: the run in the store: {forged}", file=sys.stderr)
        return 1
    if shard == 1:
        return train_joined(run_dir, address, store, answer.replica, secret=secret)
    return train_replica(run_dir, address, answer.replica, shard, secret)


def train_replica(run_dir: Path, address: str, slot: int, shard: int, secret: Path) -> int:
    """Join as an HSDP replica of `shard` processes ([Note: HSDP replicas] in replica.py): each
    is forked here and trains as its index; they meet among themselves, then enter the run as
    one replica. The replica ends as a whole: when one of them ends otherwise than with 0 the
    others are killed, and that status is this process's."""
    owner = os.getpid()

    def train(index: int) -> int:
        store = run_store(client_store(address, CONNECT_TIMEOUT_S))  # its own socket
        return train_joined(run_dir, address, store, slot, index, shard, owner, secret=secret)

    children = [fork(partial(train, index)) for index in range(shard)]
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        child, status = os.wait()
        codes[child] = os.waitstatus_to_exitcode(status)
        if codes[child] != 0:  # the replica is lost: its other processes too
            for other in children:
                if other not in codes:
                    os.kill(other, signal.SIGKILL)
    failed = [code for code in codes.values() if code != 0]
    return (failed[0] if failed[0] > 0 else 1) if failed else 0


def keep(run_dir: Path, restarts: int, secret: Path) -> int:
    """Keep a replica of the run on this machine: join, and join again when it is lost.

    [Note: the machine's keeper] The live launcher replaces the workers it started, on its own
    machine; a replica that joined from another machine is replaced by nobody (the launcher
    cannot start a process there). `dataparallel join RUN --restarts K` is that machine's
    keeper: it imports torch once, then forks the replica (a forked child starts warm: no
    import, so it asks to join within a second), waits for it, and when it ends lost (any
    status but 0, 2 or a refusal: killed, crashed, left out as stalled) forks a new one, up to
    K times; the new one joins as a new slot and is healed like any joiner. Right after a loss
    the launcher may still count the lost replica (until its heartbeat has been silent for
    HEARTBEAT_TIMEOUT_S) and refuse a join at --max-replicas: the keeper asks again each second
    for REJOIN_WAIT_S. SIGTERM to the keeper is passed to its replica and ends both (143).
    Status: 0 (the run ended, or the replica left), 1 (refused, or lost K + 1 times), 2 (bad
    input), 143 (SIGTERM).
    """
    from ..worker import run_worker  # noqa: F401  (torch and the trainer, imported once)

    lost, rejoin_until, child, stopping = 0, 0.0, 0, False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True  # the keeper ends with its replica, and joins no other
        if child:
            os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    while True:
        if stopping:
            return 128 + signal.SIGTERM
        child = fork(partial(join, run_dir, secret))  # the replica
        _, status = os.waitpid(child, 0)
        code, child = os.waitstatus_to_exitcode(status), 0
        if stopping:
            return 128 + signal.SIGTERM
        if code == REFUSED and time.monotonic() < rejoin_until:
            time.sleep(1.0)  # the lost replica may still be counted: ask again
            continue
        if code in (0, 2, REFUSED) or lost == restarts:
            return 1 if code == REFUSED or code < 0 else code
        lost += 1
        rejoin_until = time.monotonic() + REJOIN_WAIT_S
        print(
            f"dataparallel join: the replica was lost (status {code}); joining again "
            f"({lost} of --restarts {restarts})",
            file=sys.stderr,
            flush=True,
        )


def fork(run: Callable[[], int]) -> int:
    """Fork a child that runs `run` and exits with its status (a bug: its traceback, then
    status 1; SIGTERM ends it as by default); return the child's pid."""
    child = os.fork()
    if child:
        return child
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 1
    try:
        code = run()
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def train_joined(
    run_dir: Path,
    address: str,
    store,
    slot: int,
    index: int = 0,
    shard: int = 1,
    owner: int | None = None,
    *,
    secret: Path,
) -> int:
    """Train as the replica in `slot` of the live run until it ends, beating meanwhile; under
    --shard-group as its process `index` of `shard`, forked by the process `owner` that asked
    to join (the launcher knows the replica by that pid)."""
    import torch

    from ...launch.workers import fair_threads, worker_environment
    from ..handoff import decode_run
    from ..worker import ENV_LAUNCHER, run_worker

    config, _, _ = decode_run(read_run(store, secret))
    # The run directory as this process reaches it (the launcher's may be relative to its own
    # working directory, or a mount on another machine).
    config = config.replace(launch={"out": str(run_dir)})
    launch = config.launch
    environment = worker_environment(launch)
    environment.pop(ENV_LAUNCHER)  # not the launcher's child: its heartbeat ties it to the run
    os.environ.update(environment)
    live = {"store": address, "replica": slot, "joining": True, "secret": str(secret)}
    if shard > 1:  # [Note: HSDP replicas]: its first group is its own, named by its slot
        live.update(index=index, shard=shard, start=f"join-{slot}", owner=owner)
    os.environ[ENV_LIVE] = json.dumps(live)
    torch.set_num_threads(launch.threads or fair_threads(launch.nproc))
    beat_store = run_store(client_store(address, CONNECT_TIMEOUT_S))
    heartbeat = Heartbeat(beat_store, slot).start()
    code = 1
    try:
        run_worker(config, resume=False)
        code = 0
    except SystemExit as end:  # 0 once it has left, 130 on Ctrl-C...
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
        raise
    finally:
        heartbeat.stop(code)
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    """let a replica of a running `dataparallel train --recovery live` leave

    Ask the live run in RUN_DIR to let one replica leave at its next step boundary: the others
    go on without it, with the same global batch (down to its --min-replicas); it ends with
    status 0 and is not replaced.
    """
    try:
        if args.replica < 0:
            raise ConfigError("--replica", f"{args.replica} is negative", "give a replica's slot")
        secret = use_secret(Path(args.run), args.secret_file)
        _, store = connect(Path(args.run))
    except ConfigError as error:
        return refused("leave", error)
    answer = _answer("leave", store, Request(kind=LEAVE, replica=args.replica), secret)
    if answer is None:
        return 1
    if not answer.ok:
        print(
            f"dataparallel leave: refused: --replica {args.replica}: {answer.message}",
            file=sys.stderr,
        )
        return 1
    print(f"dataparallel leave: {answer.message}")
    return 0

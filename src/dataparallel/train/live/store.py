"""A live run's store: where its processes find it, how they reach it, and every key in it.

    write_run_file(run_dir, "10.0.0.7:41234")           # the launcher, when it starts
    address = read_run_file(run_dir)                    # dataparallel join / leave
    store = run_store(client_store(address))            # any process: the run's keys
    store.set(report_key(generation, slot), ...)

The launcher hosts the store (`HostedStore`, bound to the run's address only); the workers it starts find it in ENV_LIVE, a process
started outside it (`dataparallel join`, `leave`) in RUN_DIR/live.json. Every key of a run
stands under STORE_PREFIX, and is named here, by the note that says who writes and reads it:
    [Note: quorum keys] in quorum.py            latest, gen/<g>/report|decision|regroup|arrived|pg
    [Note: membership requests] in requests.py  requests, request/<n>, answer/<n>, leave/<slot>,
                                                beat/<slot>, signal/<slot>, bye/<slot>, run
    [Note: HSDP replicas] in replica.py         start/<n>/pg, vote/<slot>/<start>/...
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..config import ConfigError

# {"store": "host:port", "replica": slot, "joining": bool, "secret": the secret's file}
ENV_LIVE = "DATAPARALLEL_LIVE"
RUN_FILE = "live.json"  # in the run directory while its live launcher runs
STORE_PREFIX = "dataparallel/live"  # a live run's keys, under its launcher's store


# -- finding and reaching the store --------------------------------------------------------------
def write_run_file(run_dir: Path, address: str) -> Path:
    """Write RUN_DIR/live.json, where `dataparallel join` and `leave` find the launcher's store
    ("host:port"); written whole or not at all (a reader never sees half of it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, partial = run_dir / RUN_FILE, run_dir / f".{RUN_FILE}.{os.getpid()}"
    partial.write_text(json.dumps({"store": address, "launcher_pid": os.getpid()}) + "\n")
    os.replace(partial, path)
    return path


def read_run_file(run_dir: Path) -> str:
    """The launcher's store address from RUN_DIR/live.json (ConfigError when there is none)."""
    path = run_dir / RUN_FILE
    try:
        return json.loads(path.read_text())["store"]
    except FileNotFoundError:
        raise ConfigError(
            "RUN_DIR",
            f"{run_dir} has no live run (no {RUN_FILE}: the run was not started with --recovery "
            "live, or has ended)",
            "give the directory of a running `dataparallel train --recovery live`",
        ) from None
    except (ValueError, KeyError):
        raise ConfigError(
            "RUN_DIR", f"{path} is not a live run's file", "give a live run's directory"
        ) from None


def run_store(store: dist.Store) -> dist.PrefixStore:
    """The run's keys ([Note: quorum keys]) in the launcher's store, seen from any process."""
    return dist.PrefixStore(STORE_PREFIX, store)


class HostedStore:
    """The store a live run's launcher hosts, listening on the run's address only.

    host: the address the run names (--store-host; 127.0.0.1 when the run is on one machine).
    port: the port (0: a free one, chosen by the system).
    timeout_s: how long a call on the store waits.

    TCPStore takes no address to bind to and listens on every interface; a socket bound here
    to `host`, already listening, is handed to it as `master_listen_fd` (docs/security.md).
    `address` is "host:port", where the workers and `dataparallel join` reach it.
    """

    def __init__(self, host: str, port: int = 0, timeout_s: float = 60.0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)  # kept open while it serves
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((host, port))
        except OSError as error:
            self.listener.close()
            raise ConfigError(
                "--store-host",
                f"cannot listen on {host}:{port} ({error.strerror})",
                "give an address of this machine (or leave it out for 127.0.0.1)",
            ) from None
        self.listener.listen(512)
        self.port = self.listener.getsockname()[1]
        self.address = (
            f"[{host}]:{self.port}" if family == socket.AF_INET6 else f"{host}:{self.port}"
        )
        self.store = dist.TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=self.listener.fileno(),
        )


def client_store(address: str, timeout_s: float = 60.0) -> dist.TCPStore:
    """A worker's connection to the launcher's store at "host:port"."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


# -- the quorum's keys ([Note: quorum keys] in quorum.py) ----------------------------------------
LATEST = "latest"


def report_key(generation: int, slot: int) -> str:
    return f"gen/{generation}/report/{slot}"


def decision_key(generation: int) -> str:
    return f"gen/{generation}/decision"


def regroup_key(generation: int) -> str:
    return f"gen/{generation}/regroup"


def arrived_key(generation: int, rank: int) -> str:
    return f"gen/{generation}/arrived/{rank}"


def group_prefix(generation: int) -> str:
    return f"gen/{generation}/pg"


# -- requests from outside the launcher ([Note: membership requests] in requests.py) -------------
RUN_KEY = "run"
COUNTER = "requests"


def request_key(number: int) -> str:
    return f"request/{number}"


def answer_key(number: int) -> str:
    return f"answer/{number}"


def leave_key(slot: int) -> str:
    return f"leave/{slot}"


def beat_key(slot: int) -> str:
    return f"beat/{slot}"


def signal_key(slot: int) -> str:
    return f"signal/{slot}"


def bye_key(slot: int) -> str:
    return f"bye/{slot}"


# -- an HSDP replica's own keys ([Note: HSDP replicas] in replica.py) ----------------------------
def start_prefix(start: int | str) -> str:
    """The first group of a replica's S processes, named by its start."""
    return f"start/{start}/pg"


def vote_prefix(slot: int, start: int | str) -> str:
    """The rounds of a replica's vote."""
    return f"vote/{slot}/{start}"

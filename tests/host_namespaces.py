"""Two hosts on one machine: network namespaces joined by a shaped veth link, and a
`dataparallel train --nnodes 2` run with one node in each (the tests' and the benchmarks' one
copy: tests/e2e/test_two_hosts.py, test_cluster_hosts.py; `python benchmarks/two_hosts.py` runs
it from the command line).

Each namespace gets one end of a veth pair (10.77.0.1 and 10.77.0.2), and each end a token
bucket (`tc qdisc ... tbf rate R`) on its egress, so the link carries R each way (netem is not
available here, so there is no added latency). Node 0 runs rank 0 and writes the run; each node
pins gloo to its veth end (GLOO_SOCKET_IFNAME) and the nodes meet at 10.77.0.1. Everything
created is removed on the way out, also when the run fails or is interrupted. Needs root and
`ip netns`; `available()` says whether this machine allows them, and why not.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid

ADDRESSES = ("10.77.0.1", "10.77.0.2")
MADE: list[str] = []  # every namespace this process made, to tell its own from another's
PORT = 29517  # node 0's rendezvous port (inside its own namespace, so always free)
PYTHON = sys.executable


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"dpprobe{uuid.uuid4().hex[:6]}"
    try:
        result = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if result.returncode:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def linked_namespaces(rate: str | None = "100mbit"):
    """Two namespaces joined by a veth pair shaped to `rate` each way (None: unshaped); yields
    [(namespace, interface, address)] for node 0 and node 1, and removes them all after."""
    tag = uuid.uuid4().hex[:6]
    spaces = [f"dp{tag}n{i}" for i in range(2)]
    links = [f"dp{tag}v{i}" for i in range(2)]
    created: list[str] = []
    try:
        for space in spaces:
            _ip("netns", "add", space)
            created.append(space)
            MADE.append(space)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for space, link, address in zip(spaces, links, ADDRESSES, strict=True):
            _ip("link", "set", link, "netns", space)
            _ip("-n", space, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", space, "link", "set", link, "up")
            _ip("-n", space, "link", "set", "lo", "up")
            if rate:
                # burst: a few ms at the rate; latency: how long a packet may queue.
                subprocess.run(
                    ["ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", link, "root",
                     "tbf", "rate", rate, "burst", "256kbit", "latency", "50ms"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
        yield list(zip(spaces, links, ADDRESSES, strict=True))
    finally:
        for space in created:  # deleting a namespace deletes the veth end inside it
            _ip("netns", "del", space, check=False)


def start_in(space: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`argv` as a fresh process in the namespace `space` (`ip netns exec`), its output and
    errors in one pipe: how the nodes start unless `run_on_two_hosts` is given another way."""
    command = ["ip", "netns", "exec", space, *argv]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def leftover() -> set[str]:
    """The namespaces this process made that still exist (another process's, such as a test
    running beside this one in the suite, are not counted)."""
    listed = _ip("netns", "list").stdout
    return {line.split()[0] for line in listed.splitlines()} & set(MADE)


def run_on_two_hosts(
    command,
    rate: str | None = "100mbit",
    timeout: float = 1800,
    during=None,
    start=start_in,
):
    """Run `command(node_rank, interface)` (an argv) in each namespace at once; return (exit
    status of node 0, of node 1, their output, seconds). Node 0 is at ADDRESSES[0].
    during: called with the two processes (node 0's, node 1's) on a thread of its own while
    they run (a trial's fault, say).
    start: `start(namespace, argv, env)` starts a node's process, one with Popen's `pid`,
    `poll`, `kill`, `wait` and `communicate` (`start_in` unless given; the suite forks its
    launchers from its warm server, tests/e2e/helpers.py `start_warm`)."""
    with linked_namespaces(rate) as nodes:
        procs = []
        started = time.perf_counter()
        for node_rank, (space, link, _) in enumerate(nodes):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=link, PYTHONUNBUFFERED="1")
            procs.append(start(space, command(node_rank, link), env))
        helper = threading.Thread(target=during, args=(procs,), daemon=True) if during else None
        try:
            if helper:
                helper.start()
            outputs = [_text(p.communicate(timeout=timeout)) for p in procs]
        finally:
            if helper:
                helper.join(timeout=5)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        seconds = time.perf_counter() - started
    return procs[0].returncode, procs[1].returncode, outputs[0] + outputs[1], seconds


def _text(output: tuple) -> str:
    """A node's output and errors (bytes from a pipe, or text) as one text."""
    return "".join(o.decode() if isinstance(o, bytes) else o for o in output if o)


def train_on_two_hosts(
    args: list[str],
    out: str,
    rate: str | None = "100mbit",
    timeout=1800,
    during=None,
    start=start_in,
):
    """`dataparallel train --nnodes 2 --nproc 1 ARGS --out OUT` with one node per namespace;
    see `run_on_two_hosts` for what it returns, `during` and `start`."""

    def command(node_rank: int, link: str) -> list[str]:
        return [PYTHON, "-m", "dataparallel.cli", "train", "--nnodes", "2", "--nproc", "1",
                "--node-rank", str(node_rank), "--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}",
                "--out", out, *args]  # fmt: skip

    return run_on_two_hosts(command, rate, timeout, during, start)

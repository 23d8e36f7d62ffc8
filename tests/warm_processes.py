"""The suite's warm process server: processes forked from one that has imported torch and
dataparallel once, for the dist tests' ranks (tests/dist/harness.py) and the e2e tests'
`dataparallel` commands (`run_cli`; `WarmPopen` for one a test signals while it runs), whose own
workers are forked from them in turn.

A fresh `python -m dataparallel.cli train ...` spends about 2 s importing torch and dataparallel
and 0.5-1 s more in torch._dynamo (its preflight builds the model on the meta device) before it
starts a worker; on 2 cores a 4-step run of 2 workers took 23-25 s fresh and 13-18 s forked
from here (3 runs each, alternating, on a loaded machine). The command is the same `cli.main`
with the same arguments, environment and working directory; its workers are forked from it,
as from any `dataparallel` command on Linux with a CPU torch. What still starts as a fresh
interpreter: the trial helpers the benchmarks share (killed_runs.py, signalled_runs.py), runs
under torchrun or in another network namespace, and a user's script under `dataparallel launch`.

multiprocessing has one forkserver per process: its preload list is set here only, and the
server starts on the first process asked of it. It has started no threads and run nothing
else, so each process begins as a fresh one would.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

CONTEXT = mp.get_context("forkserver")
# A command's workers are forked from it ([Note: forked workers] in launch/forked.py), so what
# it has imported they have too: rank 0's run directory writers (TensorBoard's SummaryWriter,
# 0.4 s; the report's matplotlib, 1 s), imported here once, are not imported again by every run;
# nor are transformers, its Llama and peft (3.3 s), which an hf:DIR run's launcher imports to
# build the model on meta before it forks the workers. A module that is not installed is left
# out (multiprocessing skips a preload that raises ImportError). A test world's ranks unpickle
# their function, so they import its test module's imports: pytest (115 of the dist suite's
# 231 ranks), ZeroRedundancyOptimizer's module (0.6 s), inductor's compiler (1.4 s a rank of
# the compile tests), Lightning (0.4 s).
CONTEXT.set_forkserver_preload(
    ["torch", "dataparallel", "dataparallel.cli", "torch._dynamo"]
    + ["torch.utils.tensorboard", "matplotlib.pyplot"]
    + ["transformers", "transformers.models.llama.modeling_llama", "peft"]
    + ["pytest", "torch.distributed.optim", "torch._inductor.compile_fx", "lightning"]
)


def _cli_entry(
    args: list[str],
    env: dict[str, str],
    cwd: str,
    out: str,
    err: str,
    netns: str | None = None,
    script: str | None = None,
) -> None:
    if netns is not None:
        join_network_namespace(netns)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)  # what the workers inherit, as from subprocess.run(env=...)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    if script is not None:  # `python SCRIPT ARGS`: its folder first on the path, as python puts it
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    sys.argv = ["dataparallel", *args]
    from dataparallel.cli import main

    sys.exit(main())  # argv None: as the `dataparallel` command runs it


CLONE_NEWNET = 0x40000000


def join_network_namespace(name: str) -> None:
    """Move this process into the network namespace `name` (`ip netns add NAME`), as `ip netns
    exec` does before it runs a command: setns(2) on /var/run/netns/NAME. Its sockets from then
    on are the namespace's; it has started no thread (setns moves the calling thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the network namespace {name}")
    finally:
        os.close(fd)


class WarmPopen:
    """`dataparallel ARGS` (`python SCRIPT ARGS` with `script`) started as
    subprocess.Popen([python, -m, dataparallel.cli, *args],
    stdout=PIPE, stderr=PIPE, text=True, env=env, cwd=cwd) starts it, but forked from the warm
    server, for the tests that signal or kill the launcher while it runs. It has the Popen
    verbs they use (args, pid, returncode, poll, wait, communicate, kill; a test signals its
    `pid`); its output goes to files, read by `communicate` once the launcher has ended (no
    pipe for a killed launcher's surviving workers to hold open)."""

    def __init__(
        self,
        args: list[str],
        *,
        env=None,
        cwd=None,
        netns: str | None = None,
        script: str | None = None,
    ):
        self.args = [script or "dataparallel", *args]
        self._folder = tempfile.TemporaryDirectory(prefix="dataparallel-cli-")
        self._out = Path(self._folder.name) / "stdout"
        self._err = Path(self._folder.name) / "stderr"
        env = dict(os.environ if env is None else env)
        where = str(cwd or os.getcwd())
        entry = (list(args), env, where, str(self._out), str(self._err), netns, script)
        self._process = CONTEXT.Process(target=_cli_entry, args=entry)
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        text = lambda path: path.read_text() if path.exists() else ""  # noqa: E731
        return text(self._out), text(self._err)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def run_cli(
    args: list[str],
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    script: str | None = None,
) -> subprocess.CompletedProcess:
    """`dataparallel ARGS` run to its end in a process of its own (forked from the warm
    server), its output captured: like subprocess.run([python, -m, dataparallel.cli, *args],
    capture_output=True, text=True, timeout=timeout, env=env) without the interpreter's start.
    With `script`: `python SCRIPT ARGS` instead."""
    process = WarmPopen(args, env=env, script=script)
    try:
        stdout, stderr = process.communicate(timeout)
    except subprocess.TimeoutExpired:  # its workers die with it (train/worker.py die_with_launcher)
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

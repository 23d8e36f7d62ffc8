"""The punisher across two hosts: benchmarks/punisher.py's trial with the run spread over two
network namespaces joined by a veth pair (tests/host_namespaces.py), the kills on both.

    python benchmarks/punisher_hosts.py --steps 2000 --mean-s 30 --seed 1 --spare-regroups
    python benchmarks/punisher_hosts.py --steps 300 --mean-s 20 --seed 1 --spare-regroups \
        --rate 100mbit
    python benchmarks/punisher_hosts.py --restart --steps 2000 --mean-s 30 --seed 1

Live mode (the default): gpt-tiny with live_trials.py's flags (a global batch of 12) under
`--recovery live --max-restarts 1000`, the launcher and --nproc 2 workers on the first host
(its store at 10.77.0.1, `--max-replicas 3`), and on the second host a keeper, `dataparallel
join RUN --restarts 1000`, whose replica is the third member ([Note: the machine's keeper] in
train/live/elastic.py). punisher.py's punisher, its clock started once the second host's replica is
a member, sends SIGKILL at exponential, seeded moments to a random host's random member (with
its --min-members, --quiet-tail and --spare-regroups rules; without --spare-regroups a kill in
the window that rule spares can hang the run: docs/faults.md): a launcher's worker is replaced
by the launcher in its slot; the keeper's replica by the keeper's next one, which joins as a
new slot. The reference is the same layout uninterrupted (the same link, so the efficiency
compares like with like; the weights differ in summation order only: 2 replicas sum the first
steps, then 3). It prints punisher.py's figures with the host of each kill (0 first, 1
second), and the keeper's status and how many replicas it joined again.

Restart mode (--restart): the same run as `dataparallel train --nnodes 2 --nproc 1`, one node
per host, a checkpoint every --checkpoint-every steps, `--max-restarts 1000`; the punisher
kills the second host's worker (each kill restarts both hosts' workers from the latest
checkpoint: torchrun's agents meet again across the link), and sends the next kill only once
the run has trained past the step of the last. It prints each kill (when, pid, step, the step
the workers resumed at, and the seconds until the first step after it), the restarts, whether
the final weights are bit-identical to the same run uninterrupted, and the efficiency as wall
time from start to end, start-ups included (elapsed_s starts again with each restart).

Needs root (`ip netns`); docs/faults.md, "Live recovery", has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# The helpers this script shares with the tests (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import host_namespaces  # noqa: E402
from live_trials import flags  # noqa: E402
from punisher import (  # noqa: E402
    MetricsTail,
    OneHost,
    exponential_wait,
    parser,
    punish,
    report,
    train_steps,
)
from safetensors.torch import load_file  # noqa: E402
from worker_pids import children, workers_by_rank  # noqa: E402

CLI = [sys.executable, "-m", "dataparallel.cli"]
RESUMED = re.compile(r"resumed at step (\d+) of")


class TwoHosts(OneHost):
    """The launcher and its workers on the first host; a keeper and its replica on the second,
    started once the run has trained a step."""

    def __init__(self, nodes, out: Path, nproc: int):
        self.nodes, self.out, self.nproc = nodes, out, nproc
        self.launcher: subprocess.Popen | None = None
        self.keeper: subprocess.Popen | None = None

    def _start_on(self, node: int, argv: list[str], **popen) -> subprocess.Popen:
        space, link, _ = self.nodes[node]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=link, PYTHONUNBUFFERED="1")
        return subprocess.Popen(["ip", "netns", "exec", space, *argv], env=env, **popen)

    def start(self, argv: list[str], stdout) -> subprocess.Popen:
        self.launcher = self._start_on(0, argv, stdout=stdout, stderr=subprocess.PIPE, text=True)
        return self.launcher

    def ready(self, lines) -> bool:
        """Once the second host's replica is a member (the keeper is started on the first
        call, at the first step)."""
        if self.keeper is None:
            keeper = [*CLI, "join", str(self.out), "--restarts", "1000"]
            with open(self.out.with_suffix(".keeper"), "w") as said:
                self.keeper = self._start_on(1, keeper, stdout=said, stderr=subprocess.STDOUT)
        if self.keeper.poll() is not None:
            raise SystemExit(f"the keeper ended (status {self.keeper.returncode}) before its "
                             f"replica joined: {self.out.with_suffix('.keeper')}")  # fmt: skip
        return any(slot >= self.nproc for g in lines.generations for slot in g.members)

    def alive(self) -> dict[int, int]:
        found = super().alive()
        if self.keeper is not None:
            found.update({pid: 1 for pid in children(self.keeper.pid, deep=False)})
        return found

    def close(self) -> dict:
        """Wait for the keeper (its replica ends with the run), after stopping the launcher if
        it still runs (the trial failed): the keeper's status and rejoins."""
        for process in (self.launcher, self.keeper):
            if process is None:
                continue
            if process.poll() is None and process is self.launcher:
                process.terminate()  # its workers are stopped with it
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.keeper is None:
            return {}
        said = self.out.with_suffix(".keeper").read_text()
        return {"keeper status": self.keeper.returncode,
                "keeper joined again": said.count("joining again")}  # fmt: skip


@contextlib.contextmanager
def runs_in(out: str | None):
    """The folder of the two runs: `out` (made, and kept), or a temporary one."""
    if out:
        Path(out).mkdir(parents=True)
        yield Path(out)
        return
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


def live(args, rate: str | None) -> dict:
    """The live trial: the reference, then the punished run, on one pair of namespaces."""
    nproc = 2
    command = [*CLI, "train", *flags(args.steps, nproc=nproc), "--max-replicas", str(nproc + 1)]
    command += ["--store-host", host_namespaces.ADDRESSES[0]]
    with runs_in(args.out) as folder, host_namespaces.linked_namespaces(rate) as nodes:
        reference, out = folder / "reference", folder / "live"
        uninterrupted = argparse.Namespace(**{**vars(args), "mean_s": math.inf})
        keeper = {}
        for run, trial in ((reference, uninterrupted), (out, args)):
            hosts = TwoHosts(nodes, run, nproc)
            try:
                punished = punish(trial, run, command, hosts)
            finally:
                keeper = hosts.close()
            if run == reference and punished[0] != 0:
                print("".join(punished[2].lines[-20:]), file=sys.stderr)
                raise SystemExit(f"the uninterrupted run failed (status {punished[0]})")
        result = report(args, punished, out, reference)
        result["kills on host 1"] = sum(kill.host == 1 for kill in punished[1])
        return {**result, **keeper}


@dataclass
class Restart:
    """One SIGKILL of the second host's worker in restart mode."""

    at_s: float  # after the first step
    pid: int
    step: int  # the last step in the metrics
    before: list[dict]  # the metrics' train records then
    back_s: float | None = None  # until the metrics showed a step trained after the restart
    resumed_at: int | None = None  # the step the restarted workers started from

    def look(self, now: float, train: list[dict]) -> None:
        """Note the first record trained after the restart: the metrics are cut back to the
        checkpoint, and a restarted worker's elapsed_s starts again from 0 (a step that
        finished as the kill came is not one)."""
        if self.back_s is not None:
            return
        last = self.before[-1]["elapsed_s"] if self.before else math.inf
        was, first = self.before, len(train)  # the new records are a tail: read it backwards
        while first > 0 and (first > len(was) or train[first - 1] != was[first - 1]):
            first -= 1
        if first < len(train) and train[first]["elapsed_s"] < last:
            self.back_s, self.resumed_at = now - self.at_s, train[first]["step"] - 1


def kill_second_host(args, run: Path, kills: list[Restart]):
    """A `during` for host_namespaces.train_on_two_hosts: the punisher of restart mode."""
    rng = random.Random(args.seed)

    def during(procs) -> None:
        metrics = MetricsTail(run)
        while metrics.last_step() < 1:
            if any(p.poll() is not None for p in procs):
                return
            time.sleep(0.02)
        started, next_kill = time.monotonic(), exponential_wait(rng, args.mean_s)
        while all(p.poll() is None for p in procs):
            time.sleep(0.02)
            now, train = time.monotonic() - started, metrics.look()
            step = train[-1]["step"] if train else 0
            if kills:
                kills[-1].look(now, train)
            # The next kill once the run has trained past the last one's step.
            after = kills[-1].step if kills else 0
            if now < next_kill or step >= args.steps - args.quiet_tail or step <= after:
                continue
            victim = workers_by_rank(procs[1].pid).get(1)
            if victim is None:
                continue
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills.append(Restart(now, victim, step, list(train)))
            next_kill = now + exponential_wait(rng, args.mean_s)

    return during


def restart(args, rate: str | None) -> dict:
    """The restart trial: the reference, then the punished run, each on its own namespaces."""
    train = flags(args.steps, nproc=1, ranks=2, checkpoint_every=args.checkpoint_every)
    train += ["--max-restarts", "1000"]
    with runs_in(args.out) as folder:
        reference, out = folder / "reference", folder / "restart"
        seconds, kills = {}, []
        for run in (reference, out):
            during = kill_second_host(args, run, kills) if run == out else None
            node0, node1, output, seconds[run] = host_namespaces.train_on_two_hosts(
                train, str(run), rate, timeout=3600, during=during
            )
            if (node0, node1) != (0, 0):
                print(output[-4000:], file=sys.stderr)
                raise SystemExit(f"{run.name}: the nodes ended with status {node0} and {node1}")
        print(f"{'kill':>4} {'at s':>6} {'pid':>7} {'step':>5} {'resumed at':>10} "
              f"{'back after s':>12}")  # fmt: skip
        for n, kill in enumerate(kills, start=1):
            at = "-" if kill.resumed_at is None else str(kill.resumed_at)
            back = "-" if kill.back_s is None else f"{kill.back_s:.1f}"
            print(f"{n:>4} {kill.at_s:>6.1f} {kill.pid:>7} {kill.step:>5} {at:>10} {back:>12}")
        back = [k for k in kills if k.back_s is not None]
        ours, theirs = (load_file(str(run / "model.safetensors")) for run in (out, reference))
        identical = ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in theirs)
        done = train_steps(out)
        return {
            "kills (all on host 1)": len(kills),
            "restarts from a checkpoint": len(RESUMED.findall(output)),
            "steps trained again": sum(k.step - k.resumed_at for k in back),
            "back after s (max)": round(max((k.back_s for k in back), default=0), 1),
            "every step in the metrics once": done == list(range(1, args.steps + 1)),
            "bit-identical": identical,
            "max |difference|": max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
            "wall s, uninterrupted": round(seconds[reference], 1),
            "wall s, punished": round(seconds[out], 1),
            "efficiency (wall)": round(seconds[reference] / seconds[out], 3),
        }


def main() -> None:
    options = parser()
    options.description = __doc__.split("\n\n")[0]
    options.add_argument("--rate", default="none", help="tc tbf rate each way ('none': unshaped)")
    options.add_argument("--restart", action="store_true", help="restart mode (torchrun)")
    options.add_argument("--checkpoint-every", type=int, default=50, help="restart mode's")
    options.add_argument("--out", help="keep the runs (and the launcher's lines) in this new "
                         "folder (default: a temporary one)")  # fmt: skip
    args = options.parse_args()
    # A SIGTERM (timeout's) unwinds: the processes stopped, the namespaces removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = host_namespaces.available()
    if reason:
        raise SystemExit(f"punisher_hosts: {reason}")
    rate = None if args.rate == "none" else args.rate
    result = (restart if args.restart else live)(args, rate)
    for key, value in result.items():
        print(f"{key:32} {value}")


if __name__ == "__main__":
    main()

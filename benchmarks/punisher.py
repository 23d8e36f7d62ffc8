"""The punisher trial of live recovery: kill random replicas of a `--recovery live` run, again
and again, and check that the run goes on as if nothing had happened.

    python benchmarks/punisher.py --steps 300 --mean-s 10 --seed 1     # the trial
    python benchmarks/punisher.py --steps 200 --mean-s 5 --seed 3      # a small one, ~2 min

Runs gpt-tiny on 3 workers twice with the same flags (benchmarks/live_trials.py's):
uninterrupted, then under `--recovery live --max-restarts 1000` while a punisher (like
torchft's) sends SIGKILL to a random member, slot 0 (the writer of the records) included, at
random moments: the waits between kills are exponential with mean --mean-s seconds, counted
from the first step, and seeded (--seed). A kill waits while fewer than --min-members
replicas are members that hold the run's state (a replacement still starting is not a
member, and one just let in holds the state once it has trained a step: a run whose every
holder is lost has nothing to heal from), and none is sent once the metrics show step
--steps - --quiet-tail (a failure inside the final save is not recovered: docs/faults.md).
With --spare-regroups none is sent either from a kill until a generation decided after it has
trained a step (a member killed in that window can hang the run: docs/faults.md). It
prints one line per kill (when, on which host (0 here; benchmarks/punisher_hosts.py runs the
trial across two), which slot and pid, at which step, and how long the replacement took to
rejoin, in seconds and in steps), then whether
- the run ended with status 0;
- no survivor was restarted: every process seen as a member and never killed is a member of
  the last generation (so each slot's pid changed only when it was killed);
- every step is in metrics.jsonl exactly once;
and the max |difference| of the final weights to the uninterrupted run's, and the step
efficiency: the uninterrupted run's training time over the punished run's (metrics.jsonl's
elapsed_s at the last step; the start-up before the first step is in neither).
docs/faults.md, "Live recovery", describes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# The helpers this script shares with the tests (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from live_trials import GENERATION, flags, records  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from worker_pids import live_workers  # noqa: E402

from dataparallel.train.metrics import read_metrics  # noqa: E402


@dataclass
class Kill:
    """One SIGKILL: when (s after the first step), whom, and the step the metrics showed."""

    at_s: float
    slot: int
    pid: int
    step: int
    host: int = 0  # 0: the launcher's machine; 1: a keeper's (benchmarks/punisher_hosts.py)
    rejoined_s: float | None = None  # until a generation let its replacement in
    rejoined_steps: int | None = None

    def replaced_by(self, generation: Generation) -> bool:
        """Whether `generation` lets this member's replacement in: the launcher's takes the
        killed slot; a keeper's joins as a new slot, above every earlier one."""
        if self.host == 0:
            return self.slot in generation.healed
        return any(slot > self.slot for slot in generation.healed)


@dataclass
class Generation:
    """One `generation N: workers [...] (pids ...) at step S` line, with when it was read."""

    at: float  # time.monotonic()
    members: dict[int, int]  # slot: pid
    step: int
    healed: list[int]


class LauncherLines:
    """The launcher's stderr (its workers' too), read on a thread from its start, so that the
    pipe never fills: every line (also written to `log` as it comes), and the generations."""

    def __init__(self, launcher: subprocess.Popen, log: Path):
        self.lines: list[str] = []
        self.generations: list[Generation] = []
        self.log = log
        self.thread = threading.Thread(target=self._read, args=(launcher.stderr,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        with open(self.log, "w") as log:
            for line in stream:
                self._take(line)
                log.write(line)
                log.flush()

    def _take(self, line: str) -> None:
        self.lines.append(line)
        found = GENERATION.search(line)
        if found:
            _, slots, pids, step = found.groups()
            healed = line.split("healed [")[1].split("]")[0] if "healed [" in line else ""
            self.generations.append(
                Generation(
                    at=time.monotonic(),
                    members=dict(zip(_numbers(slots), _numbers(pids), strict=True)),
                    step=int(step),
                    healed=_numbers(healed) if healed else [],
                )
            )


def _numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def train_steps(run: Path) -> list[int]:
    """The steps in the run's metrics.jsonl so far (a line being written is not read)."""
    return [r["step"] for r in read_metrics(run) if r["kind"] == "train"]


class MetricsTail:
    """A run's train records, read on from where the last look stopped: a look every 20 ms
    costs the new lines only (reading the whole metrics.jsonl each time took a fifth of a
    core by step 3,000, beside the run it measures). The file grows by whole lines; when it is
    replaced (cut back at a rewind, or at a restart's resume) it is read again from the start."""

    def __init__(self, run: Path):
        self.path = run / "metrics.jsonl"
        self.train: list[dict] = []
        self.file: tuple[int, int] | None = None  # (device, inode) of the file read
        self.offset = 0

    def look(self) -> list[dict]:
        """The train records so far (a line being written is not read)."""
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                if (stat.st_dev, stat.st_ino) != self.file or stat.st_size < self.offset:
                    self.file, self.offset, self.train = (stat.st_dev, stat.st_ino), 0, []
                handle.seek(self.offset)
                for line in handle:
                    if not line.endswith(b"\n"):
                        break
                    record = json.loads(line) if line.strip() else {}
                    self.offset += len(line)
                    if record.get("kind") == "train":
                        self.train.append(record)
        except FileNotFoundError:
            pass
        return self.train

    def last_step(self) -> int:
        train = self.look()
        return train[-1]["step"] if train else 0


class OneHost:
    """Where the run's processes are: the launcher and all its workers on this machine.
    benchmarks/punisher_hosts.py has the same verbs for two hosts."""

    launcher: subprocess.Popen

    def start(self, argv: list[str], stdout) -> subprocess.Popen:
        """Start the launcher of the live run `argv` (its stderr piped)."""
        self.launcher = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True)
        return self.launcher

    def ready(self, lines: LauncherLines) -> bool:
        """Whether the kills' clock may start (asked from the first step on)."""
        return True

    def alive(self) -> dict[int, int]:
        """{pid: host} of the processes that may be members now."""
        return {pid: 0 for pid in live_workers(self.launcher.pid).values()}


def exponential_wait(rng: random.Random, mean_s: float) -> float:
    """An exponential wait of mean `mean_s` (inf: never)."""
    return math.inf if math.isinf(mean_s) else rng.expovariate(1 / mean_s)


def punish(
    args, out: Path, command: list[str], hosts: OneHost | None = None
) -> tuple[int, list[Kill], LauncherLines, dict]:
    """Run the live run under the punisher: (status, kills, launcher lines, first members).
    hosts: where its processes are (OneHost if None); args.mean_s inf: no kill."""
    hosts = hosts or OneHost()
    rng = random.Random(args.seed)
    live = [*command, "--recovery", "live", "--max-restarts", "1000"]
    live += ["--collective-timeout", str(args.collective_timeout), "--out", str(out)]
    with open(out.with_suffix(".stdout"), "w") as stdout:
        launcher = hosts.start(live, stdout)
    lines = LauncherLines(launcher, out.with_suffix(".stderr"))
    metrics = MetricsTail(out)
    while metrics.last_step() < 1 or not hosts.ready(lines):  # kills count from the first step
        if launcher.poll() is not None:
            raise SystemExit("the live run ended before the punisher's clock started")
        time.sleep(0.02)
    started = time.monotonic()
    first = live_workers(launcher.pid)
    kills: list[Kill] = []
    next_kill = exponential_wait(rng, args.mean_s)
    while launcher.poll() is None:
        time.sleep(0.02)
        now, step = time.monotonic() - started, metrics.last_step()
        if now < next_kill or step >= args.steps - args.quiet_tail:
            continue
        last = lines.generations[-1] if lines.generations else None
        members = last.members if last else first
        killed = {k.pid for k in kills}
        alive = hosts.alive()
        choices = sorted(s for s, p in members.items() if p not in killed and p in alive)
        # A member let in by the last generation holds the run's state once it has trained a
        # step; killing the others before that leaves nobody to heal from.
        healing = set(last.healed) if last and step <= last.step else set()
        if len(set(choices) - healing) < args.min_members:
            continue  # wait for a replacement to be let in, and to train
        if args.spare_regroups and not settled(kills, lines, started, step):
            continue
        hosts_now = sorted({alive[members[s]] for s in choices})
        if len(hosts_now) > 1:  # a host first, then a member on it: each host as often
            host = rng.choice(hosts_now)
            choices = [s for s in choices if alive[members[s]] == host]
        slot = rng.choice(choices)
        try:
            os.kill(members[slot], signal.SIGKILL)
        except ProcessLookupError:  # it ended on its own in between (the run's end)
            continue
        kills.append(Kill(now, slot, members[slot], step, host=alive[members[slot]]))
        next_kill = now + exponential_wait(rng, args.mean_s)
    lines.thread.join(timeout=10)
    for kill in kills:
        back = next(
            (g for g in lines.generations if g.at - started > kill.at_s and kill.replaced_by(g)),
            None,
        )
        if back is not None:
            kill.rejoined_s = back.at - started - kill.at_s
            kill.rejoined_steps = back.step - kill.step
    return launcher.returncode, kills, lines, first


def settled(kills: list[Kill], lines: LauncherLines, started: float, step: int) -> bool:
    """Whether the run has regrouped after the last kill: a generation decided after it has
    trained a step (its group formed). A member killed after it reported for the next
    generation, before the launcher knows it is dead (a joiner's silent heartbeat takes 10 s),
    is counted in that generation, and the others wait for it in gloo's rendezvous for good
    (docs/faults.md, "Live recovery")."""
    if not kills:
        return True
    since = [g for g in lines.generations if g.at - started > kills[-1].at_s]
    return bool(since) and step > since[-1].step


def survivors_kept(first: dict, kills: list[Kill], lines: LauncherLines) -> bool:
    """Whether every process seen as a member and never killed is in the last generation."""
    seen = set(first.values()) | {p for g in lines.generations for p in g.members.values()}
    final = lines.generations[-1].members if lines.generations else first
    return seen - {k.pid for k in kills} == set(final.values())


def parser() -> argparse.ArgumentParser:
    """The trial's options (benchmarks/punisher_hosts.py adds its own)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mean-s", type=float, default=10.0, help="mean seconds between kills")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-members", type=int, default=2, help="kill only while at least "
                        "this many members hold the state")  # fmt: skip
    parser.add_argument("--quiet-tail", type=int, default=10, help="no kill in the last steps")
    parser.add_argument("--collective-timeout", type=float, default=20.0)
    parser.add_argument("--spare-regroups", action="store_true", help="no kill between a "
                        "kill and the first step trained by a generation decided after it: a "
                        "member killed then can be counted in the next generation, whose group "
                        "then never forms (docs/faults.md, 'Live recovery')")  # fmt: skip
    return parser


def report(args, punished, out: Path, reference: Path) -> dict:
    """Print the kills of `punished` (punish's answer) and return the run's figures against
    the uninterrupted run in `reference`."""
    status, kills, lines, first = punished
    print(f"{'kill':>4} {'at s':>6} {'host':>4} {'slot':>4} {'pid':>7} {'step':>5} "
          f"{'rejoined after s':>16} {'steps':>5}")  # fmt: skip
    for n, kill in enumerate(kills, start=1):
        after = "-" if kill.rejoined_s is None else f"{kill.rejoined_s:.1f}"
        steps = "-" if kill.rejoined_steps is None else str(kill.rejoined_steps)
        print(
            f"{n:>4} {kill.at_s:>6.1f} {kill.host:>4} {kill.slot:>4} {kill.pid:>7} "
            f"{kill.step:>5} {after:>16} {steps:>5}"
        )
    if status != 0:
        print("".join(lines.lines[-20:]), file=sys.stderr)
    done = train_steps(out)
    rejoined = [k for k in kills if k.rejoined_s is not None]
    result = {
        "status": status,
        "kills": len(kills),
        "slot 0 kills": sum(k.slot == 0 for k in kills),
    }
    result["rejoined before the end"] = f"{len(rejoined)} of {len(kills)}"
    if rejoined:
        result["rejoin s (max)"] = round(max(k.rejoined_s for k in rejoined), 1)
        result["rejoin steps (max)"] = max(k.rejoined_steps for k in rejoined)
    result["generations"] = [(list(g.members), g.step) for g in lines.generations]
    result["left out as stalled"] = sum("stalled: killed" in line for line in lines.lines)
    result["survivors kept their pids"] = survivors_kept(first, kills, lines)
    result["every step once"] = done == list(range(1, args.steps + 1))
    if status == 0:
        ours = load_file(str(out / "model.safetensors"))
        theirs = load_file(str(reference / "model.safetensors"))
        difference = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
        result["max |difference|"] = f"{difference:.2e}"
        elapsed = [records(run)[-1]["elapsed_s"] for run in (reference, out)]
        result["efficiency"] = round(elapsed[0] / elapsed[1], 3)
    return result


def main() -> None:
    args = parser().parse_args()
    command = [sys.executable, "-m", "dataparallel.cli", "train", *flags(args.steps)]
    with tempfile.TemporaryDirectory() as folder:
        reference, out = Path(folder) / "reference", Path(folder) / "live"
        subprocess.run([*command, "--out", str(reference)], check=True, capture_output=True)
        result = report(args, punish(args, out, command), out, reference)
        for key, value in result.items():
            print(f"{key:28} {value}")


if __name__ == "__main__":
    main()

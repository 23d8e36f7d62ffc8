"""A trial under a real Slurm: `dataparallel cluster slurm` prints the sbatch script, sbatch runs
it, in both layouts, on a one-node cluster that this script starts and stops itself.

    apt-get install -y slurm-wlm            # Debian's (22.05 on bookworm), with munge
    sudo python benchmarks/slurm_trial.py   # about a minute on 2 cores
    sudo python benchmarks/slurm_trial.py --steps 20 --dir /tmp/trial
    sudo python benchmarks/slurm_trial.py --preempt   # the preemption trial, about 5 minutes

It writes a slurm.conf for one node, this machine (its hostname at 127.0.0.1, the CPUs and
memory `slurmd -C` reports), starts munged, slurmctld and slurmd in the foreground as its own
children, and then:
1. trains the reference run without Slurm (`dataparallel train --nproc 2`);
2. submits the printed script with one task per node (our launcher starts the 2 workers) and
   waits for it (`sbatch --wait`);
3. submits it with one task per worker (`--layout worker`: srun starts the 2 workers, each
   reads its rank from SLURM_*);
and checks that each job exited 0, printed its resolved topology, and ended with the reference
run's weights bit for bit. The daemons are stopped and their files left in --dir to read.

With --preempt (16 steps by default, a checkpoint every 8) each layout's job is submitted
without --wait instead, and once step PREEMPT_AT is in its metrics the trial sends `scancel
--batch --signal=USR1 JOB`: what the script's `--signal=B:USR1@S` sends before the time limit,
to the batch shell alone, whose trap passes it to the step (srun then signals every task once;
`--full` would also signal the tasks themselves, a second time). It checks that the step saved
the step it stopped at (the checkpoint exists when the job is requeued), that Slurm requeued the
job (`scontrol show job`: Restarts=1; no accounting here, so no sacct), that the second start
resumed at that step ("resumed at step N" in the job's output) and that the final weights equal
the reference's bit for bit. slurm.conf's `AuthInfo=cred_expire=10` lowers Slurm's delay before
a requeued job may start again from 120 s (the credential's lifetime) to 10 s.

Needs root (slurmd runs jobs as their user) and the slurm-wlm package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PYTHON = sys.executable
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
PREEMPT_AT = 4  # the trial signals the job once this step is in its metrics
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def available() -> str | None:
    """None when the trial can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root (slurmd starts the job's tasks as their user)"
    missing = [name for name in DAEMONS if not shutil.which(name)]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm)"
    return None


def slurm_conf(work: Path) -> str:
    """A one-node cluster: this machine, as `slurmd -C` describes it, at 127.0.0.1."""
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True)
    line = next(x for x in node.stdout.splitlines() if x.startswith("NodeName="))
    name = line.split()[0].split("=", 1)[1]
    return "\n".join(
        [
            "ClusterName=trial",
            f"SlurmctldHost={name}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthInfo=socket={work}/munge.socket,cred_expire=10",  # a requeued job's delay
            "AuthType=auth/munge",
            f"StateSaveLocation={work}/state",
            f"SlurmdSpoolDir={work}/spool",
            f"SlurmctldPidFile={work}/slurmctld.pid",
            f"SlurmdPidFile={work}/slurmd.pid",
            f"SlurmctldLogFile={work}/slurmctld.log",
            f"SlurmdLogFile={work}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            f"{line} NodeAddr=127.0.0.1 State=UNKNOWN",
            f"PartitionName=trial Nodes={name} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class Cluster:
    """munged, slurmctld and slurmd as children of this process, for one trial."""

    def __init__(self, work: Path):
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(work / "slurm.conf"))

    def start(self) -> Cluster:
        for sub in ("state", "spool"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        (self.work / "slurm.conf").write_text(slurm_conf(self.work))
        self._spawn(["munged", "--foreground", "--force", f"--socket={self.work}/munge.socket",
                     f"--pid-file={self.work}/munged.pid", f"--log-file={self.work}/munged.log",
                     f"--seed-file={self.work}/munged.seed"], "munged")  # fmt: skip
        self._wait_for(lambda: (self.work / "munge.socket").exists(), "munged's socket")
        self._spawn(["slurmctld", "-D", "-c", "-i"], "slurmctld")
        self._spawn(["slurmd", "-D"], "slurmd")
        self._wait_for(self._node_idle, "the node to be idle (sinfo)")
        return self

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.work / f"{name}.out", "w")  # noqa: SIM115 - the daemon's, closed with it
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=log))

    def _node_idle(self) -> bool:
        done = self.run(["sinfo", "-h", "-o", "%T"], check=False)
        return done.stdout.strip() == "idle"

    def _wait_for(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"slurm_trial: gave up waiting for {what}; see {self.work}")
            time.sleep(0.5)

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, **kw)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def clean_environment() -> dict[str, str]:
    """This process's environment without any scheduler's or launcher's variables."""
    prefixes = ("SLURM_", "PET_", "OMPI_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    want, got = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)


def print_script(work: Path, layout: str, train: list[str]) -> tuple[Path, Path]:
    """The sbatch script `dataparallel cluster slurm` prints for `layout`; (it, the run dir)."""
    out = work / layout
    printed = subprocess.run(
        [PYTHON, "-m", "dataparallel.cli", "cluster", "slurm", "--layout", layout, "--nodes", "1",
         "--name", f"trial-{layout}", "--program", f"{PYTHON} -m dataparallel.cli",
         "--out", str(out), *train],
        capture_output=True, text=True, check=True, env=clean_environment(),
    )  # fmt: skip
    script = work / f"{layout}.sbatch"
    script.write_text(printed.stdout)
    return script, out


def submit(cluster: Cluster, work: Path, layout: str, train: list[str]) -> dict:
    """Print the job file for `layout`, sbatch --wait it; what happened."""
    script, out = print_script(work, layout, train)
    started = time.perf_counter()
    done = cluster.run(["sbatch", "--wait", "--parsable", f"--chdir={work}", str(script)],
                       check=False, timeout=900)  # fmt: skip
    seconds = time.perf_counter() - started
    job = done.stdout.strip().split(";")[0]
    output = (work / f"trial-{layout}-{job}.out").read_text() if job else done.stderr
    topology = [line for line in output.splitlines() if "dataparallel train: slurm" in line]
    return {"layout": layout, "job": job, "status": done.returncode, "seconds": seconds,
            "topology": topology, "output": output, "out": out}  # fmt: skip


def last_step(out: Path) -> int:
    """The last training step in the run's metrics, 0 before the first."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x)["step"] for x in lines if x.endswith("}") and '"train"' in x]
    return max(steps, default=0)


def job_fields(cluster: Cluster, job: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as a dict (JobState, Restarts, ExitCode...)."""
    text = cluster.run(["scontrol", "show", "job", "-o", job], check=False).stdout
    return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)


def preempt(cluster: Cluster, work: Path, layout: str, train: list[str]) -> dict:
    """Submit the job for `layout`, USR1 it mid-run, follow the requeue to its end."""
    script, out = print_script(work, layout, train)
    started = time.perf_counter()
    done = cluster.run(["sbatch", "--parsable", f"--chdir={work}", str(script)])
    job = done.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 900
    signalled_at = 0
    while time.monotonic() < deadline and not signalled_at:
        if last_step(out) >= PREEMPT_AT:
            signalled_at = last_step(out)
            cluster.run(["scancel", "--batch", "--signal=USR1", job])
        elif job_fields(cluster, job).get("JobState") in ENDED:
            break
        time.sleep(0.2)
    saved_on_requeue = None
    pending_s = 0
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = job_fields(cluster, job)
        if saved_on_requeue is None and fields.get("Restarts", "0") != "0":
            saved_on_requeue = sorted(p.name for p in (out / "checkpoint").glob("step-*"))
        if saved_on_requeue is not None and fields.get("JobState") == "PENDING":
            pending_s += 1  # the seconds the requeued job waits to start again
        if fields.get("JobState") in ENDED:
            break
        time.sleep(1)
    seconds = time.perf_counter() - started
    output = (work / f"trial-{layout}-{job}.out").read_text()
    saved = re.search(r"checkpoint (step-\d+) written in ([\d.]+) s", output)
    resumed = re.search(r"resumed at step (\d+)", output)
    stopped = saved.group(1) if saved else ""
    return {"layout": layout, "job": job, "state": fields.get("JobState"),
            "exit": fields.get("ExitCode"), "restarts": fields.get("Restarts"),
            "seconds": seconds, "signalled_at": signalled_at, "stopped": stopped,
            "save_s": float(saved.group(2)) if saved else None,
            "on_disk": bool(saved_on_requeue) and stopped in saved_on_requeue,
            "resumed": int(resumed.group(1)) if resumed else None,
            "requeued": "requeueing job" in output, "pending_s": pending_s,
            "output": output, "out": out}  # fmt: skip


def report_preempt(r: dict, reference: Path) -> bool:
    """Print one layout's preemption result; whether it passed."""
    stopped = int(r["stopped"].removeprefix("step-") or -1)
    same = r["state"] == "COMPLETED" and same_weights(reference, r["out"])
    passed = (r["restarts"] == "1" and r["requeued"] and r["on_disk"] and same
              and r["resumed"] == stopped)  # fmt: skip
    print(f"slurm_trial: --preempt --layout {r['layout']}: job {r['job']}: USR1 after step "
          f"{r['signalled_at']}; stopped and saved {r['stopped'] or 'nothing'} in "
          f"{r['save_s']} s (on disk at the requeue: {r['on_disk']}); requeued: Restarts="
          f"{r['restarts']}, pending about {r['pending_s']}s; resumed at step {r['resumed']}; "
          f"{r['state']} {r['exit']} after "
          f"{r['seconds']:.1f}s in all; weights equal the reference: {same}")  # fmt: skip
    if not passed:
        print(r["output"][-4000:])
    return passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=f"/tmp/slurm-trial-{int(time.time())}")
    parser.add_argument("--steps", type=int, help="6, or 16 with --preempt")
    parser.add_argument("--preempt", action="store_true", help="the preemption trial")
    args = parser.parse_args()
    args.steps = args.steps or (16 if args.preempt else 6)
    reason = available()
    if reason:
        print(f"slurm_trial: {reason}", file=sys.stderr)
        return 2
    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    train = ["--model", "gpt-tiny", "--steps", str(args.steps), "--nproc", "2", "--threads", "1",
             "--eval-every", "0", "--checkpoint-every", "8" if args.preempt else "3",
             "--seed", "0"]  # fmt: skip
    started = time.perf_counter()
    reference = work / "reference"
    subprocess.run([PYTHON, "-m", "dataparallel.cli", "train", *train, "--out", str(reference)],
                   check=True, capture_output=True, env=clean_environment())  # fmt: skip
    print(f"slurm_trial: reference run (no Slurm) in {time.perf_counter() - started:.1f}s")
    cluster = Cluster(work)
    results = []
    try:
        cluster.start()
        version = cluster.run(["sinfo", "--version"], check=False).stdout.strip()
        print(f"slurm_trial: {socket.gethostname()}, {version}, files in {work}")
        for layout in ("node", "worker"):
            trial = preempt if args.preempt else submit
            results.append(trial(cluster, work, layout, train))
    finally:
        cluster.stop()
    if args.preempt:
        failed = sum(not report_preempt(r, reference) for r in results)
        print(f"slurm_trial: {'passed' if not failed else f'{failed} layout(s) failed'}")
        return 1 if failed else 0
    failed = 0
    for r in results:
        same = r["status"] == 0 and same_weights(reference, r["out"])
        failed += not (same and r["topology"])
        print(f"slurm_trial: --layout {r['layout']}: job {r['job']} exited {r['status']} in "
              f"{r['seconds']:.1f}s; weights equal the reference: {same}")  # fmt: skip
        for line in r["topology"]:
            print(f"    {line}")
        if r["status"] != 0 or not r["topology"]:
            print(r["output"][-3000:])
    print(f"slurm_trial: {'passed' if not failed else f'{failed} layout(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

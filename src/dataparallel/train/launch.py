"""Starting the workers of `dataparallel train`: its config travels in their environment, and
the shared launcher (launch/workers.py) starts them; a live run has its own launcher
(live/launcher.py)."""

from __future__ import annotations

from ..launch.workers import start_workers, worker_environment
from .config import RunConfig
from .handoff import ENV_RUN, encode_run

WORKER_MODULE = "dataparallel.train.worker"


def launch(config: RunConfig, *, resume: bool, checkpoint: str = "", fork: bool = False) -> int:
    """Start this machine's workers of `dataparallel train` for the (validated) `config`;
    `fork`: forked from this process, a command's own ([Note: forked workers] in
    launch/forked.py)."""
    if config.launch.recovery == "live":  # [Note: live recovery] in live/recovery.py
        from .live.launcher import launch_live

        # The global batch is the run's, whatever the number of replicas left.
        config = config.replace(train={"global_batch": config.global_batch})
        run = encode_run(config, resume, checkpoint)
        env = {**worker_environment(config.launch), ENV_RUN: run}
        return launch_live(config, env, run, fork=fork)
    env = {ENV_RUN: encode_run(config, resume, checkpoint)}
    return start_workers(config.launch, ["--module", WORKER_MODULE], env, fork=fork)

"""Starting workers, for every command: `dataparallel train`, `launch`, `generate` and `eval`.

    config.py          LaunchConfig (the [launch] section), its checks, ConfigError and the
                       field/flag labels every command's errors use
    flags.py           the launcher's flags, as `launch`, `generate` and `eval` take them
    command.py         a subcommand of `dataparallel`: its parser from its function's docstring,
                       its bad input refused on one line (every command registers through it)
    workers.py         start_workers: torch.distributed.run, threads, the workers' environment
    forked.py          workers forked from the launcher, not fresh interpreters ([Note: forked
                       workers]): torchrun's fork start method, and ForkedProcess for live runs
    stopped_workers.py continuing stopped workers told to end ([Note: stopped workers])
    topology.py        Topology (what the launcher needs to know) and the Environment interface
    slurm.py           Slurm's two layouts: one task per node, one task per worker
    environments.py    the scheduler or launcher that started the process (Slurm's two layouts,
                       Kubeflow, torchrun/Ray, MPI), one class each; detect() and the Topology
    hostlist.py        Slurm's host lists and tasks per node, expanded in pure Python
    jobfiles.py        the sbatch script and the Kubeflow TrainJob that run `dataparallel train`
    cluster_command.py `dataparallel cluster slurm|k8s ARGS...`, which prints them
    preemption.py      SIGTERM/SIGUSR1 to the launcher: PREEMPTED (75), the budget ([Note: preemption])

It imports neither train/ nor infer/: a caller hands it what to run (a module or a script, and
the job in the workers' environment), so training and inference start workers the same way.
"""

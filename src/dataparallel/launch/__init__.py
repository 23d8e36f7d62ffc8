"""Starting workers, for every command: `dataparallel train`, `launch`, `generate` and `eval`.

    config.py          LaunchConfig (the [launch] section), its checks, ConfigError and the
                       field/flag labels every command's errors use
    flags.py           the launcher's flags, as `launch`, `generate` and `eval` take them
    workers.py         start_workers: torch.distributed.run, threads, the workers' environment
    stopped_workers.py continuing stopped workers told to end ([Note: stopped workers])

It imports neither train/ nor infer/: a caller hands it what to run (a module or a script, and
the job in the workers' environment), so training and inference start workers the same way.
"""

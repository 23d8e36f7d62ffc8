"""`dataparallel train`: the configuration, the loop, and what is written around it.

By floor (each module imports only those on lower lines; `live/` is a wing of its own):

    config.py        the run's configuration (five frozen dataclasses, TOML, flags)
    run_dir.py       what a run directory holds, by name
    ledger.py        how far a run got, and its step and evaluation records (checkpoints,
                     rewinds and heals share it: [Note: the ledger])
    lr_schedule.py   warm-up + cosine learning rate, linear scaling
    state.py         TrainState: what is built once, and the ledger; DataRanks
    config_toml.py   the config as TOML, and a mapping applied onto it
    model_source.py  the run's model and tokenizer, resolved once
    sync.py          the [sync] section as a dp.Recipe; the recipe's errors spelled as flags
    callbacks.py     the Callback protocol: what logging and checkpointing plug into
    handoff.py       the run handed to the workers in their environment
    optimizer_step.py  the end of a step: clip, step the optimizer or skip the step
    step.py          a step's concerns: data, loss, verdict, vote, update
    tensor_parallel.py  the job's dp x tp mesh (--tp)
    trainer.py       setup(), train_step(), evaluate()
    metrics.py, console.py, blame.py, tracing.py, checkpointing.py   the callbacks
    preemption.py    the ranks agree on a signal, save the step and stop (exit 75)
    loop.py          fit(), extended through Steps
    checks.py        validation of a config before anything starts
    writer.py        who writes the records: rank 0 of the current world (live runs move it)
    report.py        PNG plots and the summary
    live/            live recovery: a run that loses, gains or lets go of replicas (its __init__),
                     and `dataparallel join` and `leave` (live/elastic.py)
    worker.py        one worker: prepare, fit, report
    launch.py        starting the workers (the shared launcher, launch/, does it)

See docs/train.md.
"""

"""`dataparallel train`: the configuration, the loop, and what is written around it.

    config.py        the run's configuration (five frozen dataclasses, TOML, flags)
    checks.py        validation of a config before anything starts
    launch.py        starting the workers (the shared launcher, launch/, does it)
    worker.py        one worker: prepare, fit, report
    trainer.py       TrainState, setup(), train_step(), evaluate()
    step.py          a step's concerns: data, loss, verdict, vote, update
    ledger.py        the run's ledger: how far it got (checkpoints, rewinds, heals)
    loop.py          fit() and the Callback protocol
    schedule.py      warm-up + cosine learning rate, linear scaling
    progress.py      rank 0's header and progress bar
    metrics.py       metrics.jsonl and TensorBoard
    writer.py        who writes the records: rank 0 of the current world (live runs move it)
    checkpointing.py resumable checkpoints and final weights
    report.py        PNG plots and the summary
    live/            live recovery: a run that loses, gains or lets go of replicas (its __init__)
    elastic.py       `dataparallel join` and `leave`: a live run grows or shrinks

See docs/train.md.
"""

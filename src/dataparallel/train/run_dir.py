"""What a run directory holds, by name: the files several parts of the job read and write."""

RUN_INFO = "run.json"  # the run's facts (report.py writes the summary from it; writer.py keeps it)
CHECKPOINTS = "checkpoint"  # the folder of resumable checkpoints (checkpointing.py)

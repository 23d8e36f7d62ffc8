"""What a run directory holds, by name: the files several parts of the job read and write."""

RUN_INFO = "run.json"  # the run's facts (report.py writes the summary from it; writer.py keeps it)
CHECKPOINTS = "checkpoint"  # the folder of resumable checkpoints (checkpointing.py)
TENSORBOARD = "tensorboard"  # TensorBoard's events (trackers.py)
REPORT = "report"  # the end-of-run plots and summary (report.py); the trackers get the plots
TRACKER_IDS = "trackers.json"  # the W&B and MLflow run ids a resume continues (trackers.py)

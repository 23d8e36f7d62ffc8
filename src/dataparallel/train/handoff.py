"""The run handed to the workers: the resolved config (and whether to resume, from which
checkpoint) travels in one environment variable, written by the launcher (launch.py, live/
launcher.py) and read by each worker (worker.py) and by a joiner (live/elastic.py)."""

from __future__ import annotations

import json

from .config import RunConfig
from .config_toml import apply_mapping

ENV_RUN = "DATAPARALLEL_RUN"


def encode_run(config: RunConfig, resume: bool, checkpoint: str = "") -> str:
    return json.dumps({"config": config.to_dict(), "resume": resume, "checkpoint": checkpoint})


def decode_run(text: str) -> tuple[RunConfig, bool, str]:
    data = json.loads(text)
    config = apply_mapping(RunConfig(), data["config"], ENV_RUN)
    return config, bool(data["resume"]), data.get("checkpoint", "")

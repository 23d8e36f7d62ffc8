"""The planner's one kind of bad input, reported on one line (the CLI exits 2)."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad planner input as `<field>: <problem>; <fix>` (train/config.py's ConfigError shape)."""

    def __init__(self, field: str, problem: str, fix: str):
        super().__init__(f"{field}: {problem}; {fix}")
        self.field, self.problem, self.fix = field, problem, fix

"""When each of Streaming DiLoCo's fragments has its outer step ([Note: streaming DiLoCo] in
diloco.py): pure arithmetic on step counts, no tensors."""

from __future__ import annotations


class FragmentSchedule:
    """F fragments, each synchronised every `every` steps, staggered by every / F steps, after
    `warmup` steps that average one fragment a step in turn.

    every: H, inner steps between a fragment's outer steps.
    fragments: F (it divides H).
    warmup: the warm-up's steps; the fragments' schedule counts from its end.
    """

    def __init__(self, every: int, fragments: int, warmup: int):
        self.every, self.fragments, self.warmup = every, fragments, warmup

    def warming_up(self, step: int) -> bool:
        """Whether the run's step `step` (from 1) is one of the warm-up's."""
        return step <= self.warmup

    def warm_fragment(self, step: int) -> int:
        """The fragment that the warm-up's step `step` averages."""
        return (step - 1) % self.fragments

    def starts(self, fragment: int, step: int) -> bool:
        """Whether `fragment` starts its outer step at `step`, counted from the warm-up's end."""
        return (step + fragment * (self.every // self.fragments)) % self.every == 0

    def starting(self, step: int) -> list[int]:
        """The fragments whose outer step starts at the run's step `step` (after the warm-up)."""
        return [p for p in range(self.fragments) if self.starts(p, step - self.warmup)]

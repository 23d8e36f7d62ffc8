"""Data: the distributed sampler (and, for the CLI, the built-in corpus)."""

from .sampler import DistributedSampler

__all__ = ["DistributedSampler"]

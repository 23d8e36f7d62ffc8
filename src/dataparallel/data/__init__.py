"""Data: the distributed sampler and the built-in corpus."""

from .corpus import Corpus, TokenWindows, load_corpus, stdlib_files
from .sampler import DistributedSampler

__all__ = ["Corpus", "DistributedSampler", "TokenWindows", "load_corpus", "stdlib_files"]

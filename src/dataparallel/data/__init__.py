"""Data: the distributed sampler, the built-in corpus, and `--data`'s formats (load_datasets)."""

from .corpus import Corpus, TokenWindows, load_corpus, stdlib_files
from .formats import DataError
from .loading import DataInfo, load_datasets
from .packing import IGNORE, PackedWindows
from .sampler import DistributedSampler
from .tokenizer import ByteTokenizer, HFTokenizer

__all__ = [
    "IGNORE",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "DataInfo",
    "DistributedSampler",
    "HFTokenizer",
    "PackedWindows",
    "TokenWindows",
    "load_corpus",
    "load_datasets",
    "stdlib_files",
]

"""Token files: ids already tokenized, read memory-mapped (nothing is copied or cached).

[Note: token files] A `.npy` file carries its dtype in its header: a 1-D array of uint16 or
uint32. A `.bin` file is raw ids with no header, so its dtype is a rule: `--token-dtype`
(data.token_dtype) "uint16" or "uint32", or "auto" (the default): uint16 when every id of the
tokenizer fits (vocab_size <= 65536, as nanoGPT and most pre-tokenized corpora write them),
else uint32. Every id must be below the tokenizer's vocab_size; a file is checked whole (a
scan in chunks, about 1 GB/s) before training starts, and named with its first bad id if not.
A token file is one document: no end-of-text id is added after it (put them in yourself).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .formats import DataError

TOKEN_DTYPES = ("auto", "uint16", "uint32")
_SCAN = 1 << 24  # ids per chunk of the vocabulary check


def bin_dtype(token_dtype: str, vocab_size: int) -> np.dtype:
    """The dtype of a `.bin` token file ([Note: token files])."""
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype={token_dtype!r} must be one of {', '.join(TOKEN_DTYPES)}")
    if token_dtype == "auto":
        token_dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    return np.dtype(token_dtype)


def open_token_file(path: Path, token_dtype: str, vocab_size: int) -> np.ndarray:
    """The ids of a token file, memory-mapped and 1-D (no scan of the values)."""
    if path.suffix.lower() == ".npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as error:
            raise DataError(f"{path} is not a readable .npy file ({error})", _NPY_FIX) from None
        if ids.ndim != 1 or ids.dtype not in (np.uint16, np.uint32):
            raise DataError(
                f"{path} holds a {ids.ndim}-D {ids.dtype} array, not 1-D uint16 or uint32",
                _NPY_FIX,
            )
        return ids
    dtype = bin_dtype(token_dtype, vocab_size)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"{path} has {size} bytes, not a whole number of {dtype} ids",
            "check the file, or set --token-dtype to the dtype it was written in",
        )
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


_NPY_FIX = "save a 1-D uint16 or uint32 array with numpy.save"


def check_ids(ids: np.ndarray, vocab_size: int, path: Path) -> None:
    """Every id is below `vocab_size` (a chunked scan of the whole file)."""
    for start in range(0, len(ids), _SCAN):
        chunk = ids[start : start + _SCAN]
        if len(chunk) and int(chunk.max()) >= vocab_size:
            at = start + int(np.argmax(chunk >= vocab_size))
            raise DataError(
                f"{path} holds id {int(ids[at])} at position {at}, outside the tokenizer's "
                f"vocabulary of {vocab_size}",
                "tokenize the data with the model's tokenizer, or check --token-dtype",
            )

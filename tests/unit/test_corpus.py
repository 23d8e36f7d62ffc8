"""The corpus: files, deterministic split, hash, windows."""

from __future__ import annotations

import pytest
import torch

from dataparallel.data.corpus import (
    TokenWindows,
    evenly_spaced,
    load_corpus,
    num_windows,
    split_tokens,
    stdlib_files,
    user_files,
)


def test_the_builtin_corpus_is_the_stdlib_sources():
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "textwrap.py", "argparse.py"} <= names
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert files == sorted(files, key=lambda f: f.as_posix())
    assert sum(f.stat().st_size for f in files) > 10_000_000  # ~30 MB on CPython 3.11


def test_user_files_are_read_in_path_order_and_hashed(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    corpus = load_corpus([str(tmp_path)])
    assert bytes(corpus.tokens.tolist()) == b"hello world"
    assert corpus.num_files == 2
    assert corpus.sha256 == load_corpus([str(tmp_path)]).sha256
    (tmp_path / "a.txt").write_bytes(b"hello!")
    assert corpus.sha256 != load_corpus([str(tmp_path)]).sha256
    with pytest.raises(FileNotFoundError, match="nope does not exist"):
        user_files([str(tmp_path / "nope")])


def test_split_holds_out_the_tail():
    tokens = torch.arange(100, dtype=torch.uint8)
    train, val = split_tokens(tokens, 0.1)
    assert (len(train), len(val)) == (90, 10)
    assert val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        split_tokens(tokens, 1.0)


def test_windows_shift_targets_by_one_and_share_no_target():
    tokens = torch.arange(20, dtype=torch.uint8)
    windows = TokenWindows(tokens, 4)
    assert len(windows) == num_windows(20, 4) == 4  # (20 - 1) // 4
    inputs, targets = windows.batch([0, 3])
    assert inputs.tolist() == [[0, 1, 2, 3], [12, 13, 14, 15]]
    assert targets.tolist() == [[1, 2, 3, 4], [13, 14, 15, 16]]
    assert inputs.dtype == torch.long
    every_target = torch.cat([windows[i][1] for i in range(len(windows))]).tolist()
    assert every_target == list(range(1, 17))


def test_evenly_spaced_picks_spread_out_indices():
    assert evenly_spaced(4, 10) == [0, 2, 5, 7]
    assert evenly_spaced(0, 3) == [0, 1, 2]
    assert evenly_spaced(9, 3) == [0, 1, 2]

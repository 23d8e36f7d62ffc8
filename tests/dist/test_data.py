"""Tokenization shared by the ranks ([Note: parallel tokenization] in data/loading.py): each
file tokenized once, by one rank; every rank then reads the same windows; a bad file stops
every rank with the same one-line error."""

from __future__ import annotations

import json
from hf_fixtures import Counting, make_tokenizer

from .harness import run_world


def _load_twice(world, paths: list[str], tok_dir: str):
    from dataparallel.data.formats import DataError
    from dataparallel.data.loading import load_datasets
    from dataparallel.data.tokenizer import HFTokenizer

    tokenizer = HFTokenizer.load(tok_dir)
    first, second = Counting(tokenizer), Counting(tokenizer)
    train, val, info = load_datasets(paths[:2], first, 8, 0.1, world=world)
    load_datasets(paths[:2], second, 8, 0.1, world=world)
    inputs, targets = train.batch(list(range(len(train))))
    try:
        load_datasets(paths, tokenizer, 8, 0.1, world=world)
        error = None
    except DataError as caught:
        error = str(caught)
    # One file in chunks ([Note: chunks]): both ranks tokenize a share of it.
    from dataparallel.data import units

    units.CHUNK_BYTES = 600
    chunked = Counting(tokenizer)
    load_datasets(paths[:1], chunked, 8, 0.1, world=world)
    seen = (inputs.sum().item(), targets.sum().item(), info.sha256)
    return first.calls, second.calls, *seen, error, chunked.calls


def test_each_file_is_tokenized_once_by_one_rank(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    paths = []
    for name, word in [("a", "alpha"), ("b", "beta")]:
        path = tmp_path / f"{name}.jsonl"
        lines = [json.dumps({"prompt": f"{word} {i}:", "completion": f" {i * 7}"}) for i in range(40)]
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "not fine"}\n')
    paths.append(str(bad))
    results = run_world(2, _load_twice, paths, str(tok_dir))
    (calls0, again0, *seen0, error0, chunk0), (calls1, again1, *seen1, error1, chunk1) = results
    assert (calls0, calls1) == (80, 80)  # a file each: 40 prompts and 40 completions
    assert (again0, again1) == (0, 0)  # the second run reads the cache
    assert seen0 == seen1  # the same windows and the same hash on both ranks
    assert error0 == error1 and 'c.jsonl line 2 has no "text"' in error0
    assert chunk0 > 0 and chunk1 > 0 and chunk0 + chunk1 == 80  # a.jsonl, shared out in chunks

"""`--data` formats: text, JSONL, Parquet, token files; packing, loss masks, the token cache.

Fixtures are built here: small JSONL/Parquet files and the BPE tokenizer of hf_fixtures.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_fixtures import Counting, make_tokenizer

from dataparallel.cli import main
from dataparallel.data import cache as cache_module
from dataparallel.data.cache import CACHE_DIR, CACHE_ENV, cache_folder, use_cache_dir
from dataparallel.data.corpus import TokenWindows, load_corpus
from dataparallel.data.formats import DataError
from dataparallel.data.loading import check_sources, load_datasets
from dataparallel.data.packing import IGNORE
from dataparallel.data.tokenizer import ByteTokenizer, HFTokenizer

PAIRS = [("Q: 2+2?\nA:", " 4"), ("Q: capital of France?\nA:", " Paris"), ("Say hi:", " hi!")]
CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer.load(make_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(autouse=True)
def no_cache_dir_given(monkeypatch):
    """The cache beside the data, as by default, whatever the shell running the tests sets."""
    monkeypatch.delenv(CACHE_ENV, raising=False)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _stream(windows) -> tuple[list[int], list[int]]:
    """(inputs, targets) of every window, concatenated."""
    inputs, targets = windows.batch(list(range(len(windows))))
    return inputs.flatten().tolist(), targets.flatten().tolist()


def test_text_with_the_byte_tokenizer_reads_as_before(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello world, " * 20)
    train, val, info = load_datasets([str(tmp_path)], ByteTokenizer(), 8, 0.25)
    corpus = load_corpus([str(tmp_path)])
    assert isinstance(train, TokenWindows) and (info.sha256, info.num_tokens) == (
        corpus.sha256,
        260,
    )
    assert (len(train), len(val)) == ((195 - 1) // 8, (65 - 1) // 8)
    assert not (tmp_path / CACHE_DIR).exists()  # bytes are their own tokens: nothing cached


def test_jsonl_text_documents_are_packed_with_eos_between(tmp_path, tokenizer):
    docs = ["def f(x):\n    return x\n", "import os\n", "class A:\n    pass\n"] * 4
    path = _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    train, val, info = load_datasets([str(path)], tokenizer, 4, 0.2)
    expected = []
    for d in docs:
        expected += tokenizer.encode(d) + [tokenizer.eos_id]
    assert info.num_tokens == len(expected) == info.target_tokens  # text: every token counts
    cut = len(expected) - int(len(expected) * 0.2)
    inputs, targets = train.batch([0, 2])
    assert inputs.tolist() == [expected[0:4], expected[8:12]]
    assert targets.tolist() == [expected[1:5], expected[9:13]]
    assert len(train) == (cut - 1) // 4 and len(val) == (len(expected) - cut - 1) // 4
    assert val.batch([0])[0].tolist() == [expected[cut : cut + 4]]
    assert info.formats == ("jsonl",)


def test_prompt_completion_counts_only_completion_tokens(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS] * 3)
    train, _, info = load_datasets([str(path)], tokenizer, 1, 0.1)
    stream, mask = [], []
    for p, c in PAIRS * 3:
        prompt, completion = tokenizer.encode(p), tokenizer.encode(c)
        stream += prompt + completion + [tokenizer.eos_id]
        mask += [False] * len(prompt) + [True] * (len(completion) + 1)  # the eos ends the answer
    assert info.num_tokens == len(stream)
    per_record = [len(tokenizer.encode(c)) + 1 for _, c in PAIRS]
    assert info.target_tokens == sum(mask) == 3 * sum(per_record)
    inputs, targets = _stream(train)  # windows of 1: the stream itself, target by target
    n = len(inputs)
    assert inputs == stream[:n]  # the prompts stay in the inputs
    assert targets == [
        t if m else IGNORE for t, m in zip(stream[1 : n + 1], mask[1 : n + 1], strict=True)
    ]
    assert sum(t != IGNORE for t in targets) == sum(mask[1 : n + 1]) < n


def test_chat_targets_are_the_assistant_replies(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    data = load_datasets([str(path)], tokenizer, 1, 0.05)[0]
    _, targets = _stream(data)
    counted = [t for t in targets if t != IGNORE]
    # The replies with the template's end of turn, then the eos after the conversation.
    text = tokenizer.decode(counted)
    assert text.startswith("4<|endoftext|>\n6<|endoftext|>\n<|endoftext|>")
    inputs, _ = _stream(data)
    assert "<|user|>\n2+2?" in tokenizer.decode(inputs)  # the rest is context
    segments = tokenizer.render_chat(CHATS[1])
    assert segments == [
        ("<|user|>\nhi<|endoftext|>\n<|assistant|>\n", False),
        ("hello there<|endoftext|>\n", True),
    ]


def test_parquet_reads_as_jsonl(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": p, "completion": c} for p, c in PAIRS] * 4
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    chats = [{"messages": m} for m in CHATS]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "c.parquet")
    _jsonl(tmp_path / "d.jsonl", records)
    _jsonl(tmp_path / "c.jsonl", chats)
    for name in ("d", "c"):
        from_parquet = load_datasets([str(tmp_path / f"{name}.parquet")], tokenizer, 2, 0.1)
        from_jsonl = load_datasets([str(tmp_path / f"{name}.jsonl")], tokenizer, 2, 0.1)
        assert _stream(from_parquet[0]) == _stream(from_jsonl[0])
        assert from_parquet[2].target_tokens == from_jsonl[2].target_tokens


def test_token_files_are_memory_mapped_and_checked(tmp_path, tokenizer):
    ids = np.arange(100) % 300
    np.save(tmp_path / "a.npy", ids.astype(np.uint32))
    ids.astype(np.uint16).tofile(tmp_path / "b.bin")  # auto: uint16 for a 384-id vocabulary
    train, _, info = load_datasets(
        [str(tmp_path / "a.npy"), str(tmp_path / "b.bin")], tokenizer, 9, 0.1
    )
    assert info.num_tokens == 200 and info.formats == ("tokens",)
    inputs, targets = train.batch([0, 11])
    assert inputs.tolist() == [list(range(9)), [99, 0, 1, 2, 3, 4, 5, 6, 7]]  # across files
    assert targets[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert not (tmp_path / CACHE_DIR).exists()
    # uint32 .bin by the flag; read as uint16 it would be 400 ids, most of them 0.
    ids.astype(np.uint32).tofile(tmp_path / "c.bin")
    wide = load_datasets([str(tmp_path / "c.bin")], tokenizer, 9, 0.1, token_dtype="uint32")
    assert wide[2].num_tokens == 100
    # An id outside the vocabulary, named with its position.
    np.save(tmp_path / "bad.npy", np.array([1, 2, 384, 3] * 10, dtype=np.uint16))
    with pytest.raises(DataError, match=r"bad.npy holds id 384 at position 2, outside .* 384"):
        check_sources([str(tmp_path / "bad.npy")], tokenizer)
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    with pytest.raises(DataError, match="odd.bin has 3 bytes, not a whole number of uint16"):
        load_datasets([str(tmp_path / "odd.bin")], tokenizer, 1, 0.5)


def test_the_cache_is_read_the_second_time_and_keyed_by_content_and_tokenizer(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS] * 5)
    first = Counting(tokenizer)
    windows = load_datasets([str(path)], first, 4, 0.1)
    assert first.calls == 2 * 15  # a prompt and a completion per record
    entries = sorted((tmp_path / CACHE_DIR).iterdir())
    assert [e.name.split(".")[2] for e in entries] == [tokenizer.fingerprint]
    second = Counting(tokenizer)
    again = load_datasets([str(path)], second, 4, 0.1)
    assert second.calls == 0  # read from the cache
    assert _stream(again[0]) == _stream(windows[0])
    # A changed file: a new entry, and the stale one is gone.
    _jsonl(path, [{"prompt": p, "completion": c + "."} for p, c in PAIRS] * 5)
    third = Counting(tokenizer)
    load_datasets([str(path)], third, 4, 0.1)
    assert third.calls == 30
    (entry,) = (tmp_path / CACHE_DIR).iterdir()
    assert entry not in entries and cache_module.content_sha256(path) in entry.name
    # Another tokenizer: its own entry beside the first.
    other = Counting(ByteTokenizer())
    load_datasets([str(path)], other, 4, 0.1)
    assert other.calls == 30 and len(list((tmp_path / CACHE_DIR).iterdir())) == 2


def test_a_cache_write_killed_midway_leaves_no_entry(tmp_path, tokenizer, monkeypatch):
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "some text " * 5}] * 10)

    def dies(stream, array, allow_pickle):
        stream.write(b"\x93NUMPY half a header")
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module.np, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        load_datasets([str(path)], tokenizer, 4, 0.1)
    assert list((tmp_path / CACHE_DIR).iterdir()) == []  # no entry, no temporary file
    monkeypatch.undo()
    # A temporary file left by a kill -9 is never read as an entry.
    (tmp_path / CACHE_DIR / ".tmp-x.npy").write_bytes(b"garbage")
    counting = Counting(tokenizer)
    load_datasets([str(path)], counting, 4, 0.1)
    assert counting.calls == 10


def test_folders_take_data_files_by_extension_and_skip_the_cache(tmp_path, tokenizer):
    _jsonl(tmp_path / "a.jsonl", [{"text": "alpha " * 10}] * 3)
    np.save(tmp_path / "b.npy", np.arange(50, dtype=np.uint16))
    (tmp_path / "c.txt").write_text("gamma " * 10)
    load_datasets([str(tmp_path)], tokenizer, 4, 0.1)  # writes .dpcache inside the folder
    _, _, info = load_datasets([str(tmp_path)], tokenizer, 4, 0.1)
    assert info.num_files == 3 and info.formats == ("jsonl", "text", "tokens")


def test_the_cache_folder_is_the_flag_then_the_environment_then_beside_the_data(
    tmp_path, monkeypatch, capsys
):
    data = tmp_path / "data" / "d.jsonl"
    data.parent.mkdir()
    assert cache_folder(data) == tmp_path / "data" / CACHE_DIR
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    mirrored = tmp_path.resolve().relative_to("/") / "data"  # in the path of the data's folder
    assert cache_folder(data) == tmp_path / "env" / mirrored
    other = tmp_path / "other" / "d.jsonl"  # the same name elsewhere: its own folder
    assert cache_folder(other) == tmp_path / "env" / mirrored.parent / "other"
    monkeypatch.chdir(tmp_path)
    use_cache_dir(None)  # no flag: the environment stands
    assert cache_folder(data) == tmp_path / "env" / mirrored
    use_cache_dir("flag")  # the flag wins, made absolute for workers started elsewhere
    assert os.environ[CACHE_ENV] == str(tmp_path / "flag")
    assert cache_folder(data) == tmp_path / "flag" / mirrored
    # Both commands that tokenize take it (--print-config and a missing run: no process).
    assert main(["train", "--cache-dir", "t", "--print-config"]) == 0
    assert os.environ[CACHE_ENV] == str(tmp_path / "t")
    assert main(["eval", "nope", "--data", str(tmp_path), "--cache-dir", "e"]) == 2
    assert os.environ[CACHE_ENV] == str(tmp_path / "e")
    capsys.readouterr()
    # Nothing given and a data folder that cannot be written: the user's cache folder.
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
    assert cache_folder(data) == tmp_path / "xdg" / "dataparallel" / "tokens" / mirrored


def test_a_read_only_data_folder_is_tokenized_into_the_cache_given(
    tmp_path, tokenizer, monkeypatch
):
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "d.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS] * 5)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    data.chmod(0o555)  # read-only for a user other than root (the cache must go elsewhere)
    try:
        first, second = Counting(tokenizer), Counting(tokenizer)
        windows = load_datasets([str(data)], first, 4, 0.1)
        again = load_datasets([str(data)], second, 4, 0.1)
    finally:
        data.chmod(0o755)
    assert (first.calls, second.calls) == (30, 0)  # the second run read the cache
    assert _stream(again[0]) == _stream(windows[0])
    assert [p.name for p in data.iterdir()] == ["d.jsonl"]  # nothing written beside the data
    (entry,) = (tmp_path / "cache").rglob("*.npy")
    assert entry.parent == cache_folder(data / "d.jsonl") and entry.name.startswith("d.jsonl.")


def test_a_cache_that_cannot_be_written_or_would_be_read_as_data_is_one_line(
    tmp_path, tokenizer, monkeypatch
):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "some words here"}] * 20)
    (tmp_path / "file").write_text("")  # a folder below a file cannot be made, even by root
    fix = f"give a writable folder with --cache-dir or {CACHE_ENV}"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file" / "cache"))
    with pytest.raises(DataError, match=r"cannot write the token cache in .*file/cache/") as given:
        load_datasets([str(path)], tokenizer, 4, 0.1)
    # A data folder that cannot be written (os.access says so for root too) and no folder
    # given: the user's cache folder, which cannot be written either.
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "xdg"))
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
    with pytest.raises(DataError, match=r"cannot write the token cache in .*file/xdg/") as home:
        load_datasets([str(path)], tokenizer, 4, 0.1)
    for caught in (given, home):
        assert str(caught.value).endswith(fix) and "\n" not in str(caught.value)
    monkeypatch.undo()
    # Inside a folder of the data, the entries would be read back as token files.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tokens"))
    with pytest.raises(DataError, match=r"tokens is inside the data folder .*, which would read"):
        load_datasets([str(tmp_path)], tokenizer, 4, 0.1)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / ".tokens"))  # hidden: never walked
    assert load_datasets([str(tmp_path)], tokenizer, 4, 0.1)[2].num_files == 2


@pytest.mark.parametrize(
    "lines, fragments",
    [
        (
            ['{"prompt": "a", "completion": "b"}', "", '{"prompt": "c"}'],
            ["l.jsonl line 3", '"completion"', "give every record"],
        ),
        (['{"txt": "a"}'], ["l.jsonl line 1", '"text", "prompt"/"completion" or "messages"']),
        (['{"text": 3}'], ['"text" is int, not a string']),
        (["not json"], ["l.jsonl line 1 is not JSON"]),
        (['{"messages": [{"role": "user"}]}'], ['"messages" is not a list']),
    ],
)
def test_bad_records_name_the_file_the_line_and_the_field(tmp_path, tokenizer, lines, fragments):
    path = tmp_path / "l.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for call in (
        lambda: check_sources([str(path)], tokenizer),
        lambda: load_datasets([str(path)], tokenizer, 1, 0.5),
    ):
        with pytest.raises(DataError) as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message and "; " in message
        for fragment in fragments:
            assert fragment in message, message


def test_chat_without_a_template_and_a_bad_parquet_are_refused(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[1]}])
    with pytest.raises(DataError, match="c.jsonl holds chat messages but the tokenizer has no"):
        check_sources([str(path)], ByteTokenizer())
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="x.parquet is not a readable Parquet file"):
        check_sources([str(tmp_path / "x.parquet")], ByteTokenizer())


def test_windows_are_int64_and_a_dataset_too_small_is_named(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "s.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match="training and .* validation windows of 64 tokens"):
        load_datasets([str(path)], tokenizer, 64, 0.5)
    big = _jsonl(tmp_path / "b.jsonl", [{"text": "some words here"}] * 20)
    inputs, targets = load_datasets([str(big)], tokenizer, 4, 0.5)[0].batch(torch.tensor([1]))
    assert inputs.dtype == targets.dtype == torch.long and inputs.shape == (1, 4)


def test_a_large_file_is_tokenized_in_chunks_cut_at_line_ends(tmp_path, tokenizer, monkeypatch):
    from dataparallel.data import units

    records = [
        {"prompt": f"Q{i}: {'word ' * (i % 7)}", "completion": f" answer {i}"} for i in range(60)
    ]
    path = _jsonl(tmp_path / "big.jsonl", records)
    whole = load_datasets([str(path)], tokenizer, 4, 0.1)
    monkeypatch.setattr(units, "CHUNK_BYTES", 500)
    cuts = units.line_cuts(path, path.stat().st_size, 500)
    data = path.read_bytes()
    assert len(cuts) > 5 and all(data[c - 1 : c] == b"\n" for c in cuts[1:])
    counting = Counting(tokenizer)
    chunked = load_datasets([str(path)], counting, 4, 0.1)
    assert counting.calls == 120  # every record once
    # One entry a chunk; the whole file's entry, not used any more, was pruned.
    assert len(list((tmp_path / CACHE_DIR).iterdir())) == len(cuts) - 1
    assert _stream(chunked[0]) == _stream(whole[0])  # records are tokenized one by one anyway
    assert chunked[2].target_tokens == whole[2].target_tokens
    # A bad record in a later chunk is named by its line in the file.
    lines = path.read_text().splitlines()
    lines[49] = '{"prompt": "no completion"}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match='big.jsonl line 50 has no "completion"'):
        load_datasets([str(path)], tokenizer, 4, 0.1)
    # Text: pieces tokenized apart, the end-of-text id only after the last.
    text = "".join(f"line {i}: {'abc ' * (i % 5)}\n" for i in range(100))
    (tmp_path / "t.txt").write_text(text)
    train, val, info = load_datasets([str(tmp_path / "t.txt")], tokenizer, 1, 0.01)
    (inputs, targets), (val_inputs, val_targets) = _stream(train), _stream(val)
    stream = inputs + targets[-1:] + val_inputs + val_targets[-1:]  # windows of 1 token
    assert len(stream) == info.num_tokens
    assert tokenizer.decode(stream) == text + "<|endoftext|>"
    assert stream.count(tokenizer.eos_id) == 1


def test_the_check_before_a_run_reads_every_record_not_yet_cached(tmp_path, tokenizer):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(300)]
    path = tmp_path / "late.jsonl"
    path.write_text("\n".join(lines) + "\n")
    files = check_sources([str(path)], tokenizer)
    assert files == [(path, "jsonl")] and not (tmp_path / CACHE_DIR).exists()  # nothing written
    path.write_text("\n".join(lines[:250] + ['{"txt": "oops"}'] + lines[250:]) + "\n")
    with pytest.raises(DataError, match='late.jsonl line 251 has no "text" field'):
        check_sources([str(path)], tokenizer)


def test_a_chat_template_that_fails_is_one_line(tmp_path, tokenizer):
    strict = HFTokenizer(tokenizer.hf.__class__.from_pretrained(tokenizer.hf.name_or_path), "x")
    strict.hf.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(DataError, match=r"c.jsonl: the chat template failed .*no system role"):
        check_sources([str(path)], strict)

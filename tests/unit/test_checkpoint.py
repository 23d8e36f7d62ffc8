"""Checkpoint files in one process: chunks reshard, commits are atomic, damage and foreign
code are refused with one line, the exported weights load with plain torch, and the data
position moves between world sizes without skipping or repeating a sample."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from safetensors.torch import load_file

from dataparallel.checkpoint import (
    CheckpointError,
    Chunk,
    begin,
    commit,
    latest_checkpoint,
    load_chunks,
    read_metadata,
    save_chunks,
    stored_tensors,
    verify,
    write_safetensors,
)
from dataparallel.compression.feedback import keyed_tensors, load_keyed_tensors
from dataparallel.data.sampler import DistributedSampler
from dataparallel.data.stream import SampleStream, share, split_evenly
from dataparallel.train.checks import keep_global_batch, resolve_batch
from dataparallel.train.config import ConfigError, RunConfig


def _save(folder, step: int, value: float = 1.0):
    tmp = begin(folder, step)
    chunks = {"w": Chunk(torch.arange(10.0) * value), "step": Chunk(torch.tensor(3.0))}
    save_chunks(chunks, tmp, None)
    return commit(tmp, {"step": step})


def test_a_whole_tensor_loads_into_any_runs_of_it(tmp_path):
    path = _save(tmp_path, 1)
    for start, stop in [(0, 4), (4, 10), (3, 7)]:
        dest = Chunk(torch.zeros(stop - start), start, 10)
        load_chunks({"w": dest}, path, None)
        assert dest.tensor.tolist() == list(map(float, range(start, stop)))
    assert stored_tensors(path) == {
        "w": (torch.Size([10]), torch.float32),
        "step": (torch.Size([]), torch.float32),
    }


def test_commits_are_atomic_and_the_two_newest_are_kept(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    (tmp_path / "step-000008.tmp").mkdir()  # a save that was killed
    assert latest_checkpoint(tmp_path).name == "step-000006"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-000004", "step-000006", "step-000008.tmp"]
    assert verify(tmp_path / "step-000006") == {"step": 6}
    _save(tmp_path, 10)  # the next save clears the leftover
    assert not (tmp_path / "step-000008.tmp").exists()
    assert latest_checkpoint(tmp_path / "none") is None


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_is_named_with_the_checkpoint_before_it(tmp_path, damage):
    _save(tmp_path, 2)
    last = _save(tmp_path, 4)
    data = next(last.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    if damage == "truncate":
        data.write_bytes(raw[: len(raw) // 2])
    else:
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(raw)
    with pytest.raises(CheckpointError) as error:
        verify(last)
    message = str(error.value)
    assert "\n" not in message and str(data) in message
    assert ("truncated" if damage == "truncate" else "corrupted") in message
    assert f"--resume {tmp_path / 'step-000002'}" in message
    assert verify(tmp_path / "step-000002") == {"step": 2}  # the previous one is intact


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_in_the_metadata_never_runs(tmp_path):
    path = _save(tmp_path, 2)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load posix.system"):
        read_metadata(path)
    with pytest.raises(ValueError, match="refusing to load posix.system"):
        load_chunks({"w": Chunk(torch.zeros(10))}, path, None)
    assert not marker.exists()


def test_a_pickle_payload_in_a_data_file_never_runs(tmp_path):
    path = _save(tmp_path, 2)
    marker = tmp_path / "pwned"
    data = next(path.glob("*.distcp"))
    data.write_bytes(pickle.dumps(_Payload(marker)) * 8)  # long enough for every slice
    # torch 2.13 says "Weights only load failed"; 2.11 (the GPU machine's) runs out of bytes: EOFError
    with pytest.raises(
        CheckpointError, match="cannot be loaded: .*(Weights only load failed|EOFError)"
    ):
        load_chunks({"w": Chunk(torch.zeros(10))}, path, None)
    assert not marker.exists()


def test_exported_weights_load_with_plain_torch_one_tensor_at_a_time(tmp_path):
    values = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.ones(2)}
    asked = []

    def read(name):
        asked.append(name)
        return values[name].reshape(-1)

    entries = [(k, list(v.shape), v.dtype) for k, v in values.items()]
    write_safetensors(tmp_path / "w.safetensors", entries, read, {"step": 7})
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in values.items())
    assert asked == ["a", "b", "c"]


def test_the_stream_matches_the_sampler_in_the_first_epoch():
    stream = SampleStream(50, seed=3)
    shards = [DistributedSampler(50, rank=r, world_size=2, seed=3).shard() for r in range(2)]
    first = [stream.at(2 * k + r) for k in range(25) for r in range(2)]
    assert first == [int(shards[r][k]) for k in range(25) for r in range(2)]


def test_a_resize_neither_skips_nor_repeats_a_sample():
    """6 steps of a global batch of 12 on 2 ranks, then 4 ranks, then 3: the 18 steps train
    on the stream's first 216 positions, each exactly once (3 epochs of 72 samples)."""
    stream, taken = SampleStream(72, seed=1), []
    for world, steps in [(2, 6), (4, 6), (3, 6)]:
        for _ in range(steps):
            step = []
            for rank in range(world):
                position = stream.consumed
                step += stream.take(12 // world, rank, world)
                stream.consumed = position  # every rank reads the same step
            stream.consumed += 12
            taken += step
    assert stream.consumed == 216
    for epoch in range(3):
        assert sorted(taken[72 * epoch : 72 * (epoch + 1)]) == list(range(72))


def test_an_uneven_split_hands_out_every_sample_once():
    """A global batch of 8 over 2, 3, 5, 1 and 7 ranks (shares 4,4 / 3,3,2 / 2,2,2,1,1 / 8 /
    2,1,1,1,1,1,1): 5 steps each, 200 positions over an epoch of 40, each once per epoch."""
    stream, taken = SampleStream(40, seed=2), []
    for world in (2, 3, 5, 1, 7):
        for _ in range(5):
            position, parts = stream.consumed, []
            for rank in range(world):
                stream.consumed = position  # every rank reads the same step
                parts.append(stream.take_share(8, rank, world))
            assert sorted(len(p) for p in parts)[-1] - sorted(len(p) for p in parts)[0] <= 1
            assert [len(p) for p in parts] == [share(8, r, world) for r in range(world)]
            taken += [i for p in parts for i in p]
    assert stream.consumed == 200 and len(taken) == 200
    for epoch in range(5):
        assert sorted(taken[40 * epoch : 40 * (epoch + 1)]) == list(range(40))
    assert [len(p) for p in split_evenly(list(range(5)), 3)] == [2, 2, 1]
    assert split_evenly(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]


def _run(batch, accum, nproc):
    return RunConfig().replace(train={"batch": batch, "accum": accum}, launch={"nproc": nproc})


def test_a_resize_keeps_the_global_batch_or_is_refused():
    base = _run(8, 1, 4)  # 32 windows per step
    assert keep_global_batch(base, _run(8, 1, 2), {}).train.accum == 2
    three = keep_global_batch(_run(6, 1, 2), _run(6, 1, 3), {})  # 12 = 4 x 1 x 3
    assert (three.train.batch, three.train.accum) == (4, 1)
    uneven = keep_global_batch(base, _run(8, 1, 3), {})  # 32 = 11,11,10: accum kept
    assert (uneven.train.batch, uneven.train.accum, uneven.train.global_batch) == (11, 1, 32)
    assert uneven.global_batch == 32
    small = keep_global_batch(_run(1, 4, 2), _run(1, 4, 3), {})  # 8 on 3 ranks: accum 4 -> 2
    assert (small.train.batch, small.train.accum, small.global_batch) == (2, 2, 8)
    back = keep_global_batch(uneven, resolve_batch(uneven.replace(launch={"nproc": 4})), {})
    assert (back.train.batch, back.train.accum, back.train.global_batch) == (8, 1, 0)
    with pytest.raises(ConfigError, match="--nproc .*33 ranks cannot share .* 32 windows"):
        keep_global_batch(base, _run(8, 1, 33), {})
    with pytest.raises(ConfigError, match="global batch of 32 windows, these flags give 64"):
        keep_global_batch(base, _run(16, 1, 4), {"batch": 16})


def test_compression_state_round_trips_by_name():
    stores = {"residual": {(0, "all"): torch.ones(3)}, "p": {(1, "replicas"): torch.zeros(2)}}
    named = keyed_tensors(stores)
    assert sorted(named) == ["p/(1, 'replicas')", "residual/(0, 'all')"]
    fresh = {"residual": {}, "p": {}}
    load_keyed_tensors(fresh, named)
    assert torch.equal(fresh["residual"][(0, "all")], torch.ones(3))
    assert list(fresh["p"]) == [(1, "replicas")]

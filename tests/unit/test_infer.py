"""The pure parts of generate and eval: shares, batches, padding, stop tokens, job transport."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from dataparallel.infer.decoding import Sampling, cut_at_stop, left_pad
from dataparallel.infer.evaluate import EvalJob
from dataparallel.infer.generate import GenerateJob, plan_batches
from dataparallel.infer.model_loading import ModelSource
from dataparallel.infer.ranks import contiguous_share, strided_share
from dataparallel.infer.worker import decode_job, encode_job
from dataparallel.launch.workers import shutdown_timeout, torchrun_argv, worker_environment
from dataparallel.train.config import LaunchConfig


def _world(rank: int, size: int):
    return SimpleNamespace(rank=rank, world_size=size)


def test_shares_cover_every_item_once():
    for count in (0, 1, 5, 7, 16):
        for size in (1, 2, 3, 8):
            contiguous = [list(contiguous_share(count, _world(r, size))) for r in range(size)]
            strided = [list(strided_share(count, _world(r, size))) for r in range(size)]
            assert sum(contiguous, []) == list(range(count))
            assert sorted(sum(strided, [])) == list(range(count))
            lengths = [len(s) for s in contiguous]
            assert max(lengths) - min(lengths) <= 1
    assert [list(contiguous_share(5, _world(r, 2))) for r in range(2)] == [[0, 1], [2, 3, 4]]


def test_batches_sorted_by_length_and_of_one_length_for_the_byte_gpt():
    lengths = {10: 3, 11: 5, 12: 3, 13: 4, 14: 5}
    assert plan_batches(lengths, 2, same_length=False) == [[10, 12], [13, 11], [14]]
    assert plan_batches(lengths, 2, same_length=True) == [[10, 12], [13], [11, 14]]
    assert plan_batches({}, 4, same_length=True) == []


def test_left_padding_aligns_prompts_on_the_right():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_completions_end_before_the_first_stop_token():
    assert cut_at_stop([4, 2, 9, 2], frozenset({2})) == [4]
    assert cut_at_stop([4, 5], frozenset({2})) == [4, 5]
    assert cut_at_stop([4, 5], frozenset()) == [4, 5]


def test_greedy_is_argmax_and_sampling_follows_each_prompts_seed():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    greedy = Sampling()
    assert greedy.choose(logits, greedy.generators([0, 1])).tolist() == [1, 0]
    sampling = Sampling(temperature=1.0, top_k=2, seed=3)
    rows = torch.randn(4, 50)
    together = sampling.choose(rows, sampling.generators([7, 8, 9, 10]))
    alone = [sampling.choose(rows[i : i + 1], sampling.generators([7 + i])) for i in range(4)]
    assert together.tolist() == torch.cat(alone).tolist()  # a prompt's draw ignores its batch


def test_a_job_travels_to_the_workers_unchanged():
    source = ModelSource("hf", Path("/models/llama"))
    job = GenerateJob(
        prompts="p.jsonl", out="o.jsonl", tokens=9, batch=3, sampling=Sampling(seed=4)
    )
    assert decode_job(encode_job("generate", source, "zero3", job)) == (
        "generate",
        source,
        "zero3",
        job,
    )
    job = EvalJob(paths=("a", "b"), block=64)
    assert decode_job(encode_job("eval", source, "ddp", job))[3] == job


def test_one_torchrun_argv_for_every_command():
    launch = LaunchConfig(nproc=3, max_restarts=1)
    argv = torchrun_argv(launch, ["script.py", "--lr", "1"], port=1234)
    assert argv == [
        "--nnodes=1", "--node-rank=0", "--nproc-per-node=3", "--master-addr=127.0.0.1",
        "--master-port=1234", "--max-restarts=1", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
        *shutdown_timeout(25), "script.py", "--lr", "1",
    ]  # fmt: skip
    nodes = LaunchConfig(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500")
    assert torchrun_argv(nodes, ["--module", "m"])[3:5] == [
        "--master-addr=10.0.0.1",
        "--master-port=29500",
    ]
    env = worker_environment(LaunchConfig(threads=3, collective_timeout=12, check_collectives=True))
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["DATAPARALLEL_COLLECTIVE_TIMEOUT"] == "12.0"
    assert env["DATAPARALLEL_CHECK_COLLECTIVES"] == "1"


def test_init_reads_the_launchers_settings(monkeypatch):
    from dataparallel.runtime import launcher_settings

    assert launcher_settings(None, None) == (0.0, False)
    monkeypatch.setenv("DATAPARALLEL_COLLECTIVE_TIMEOUT", "42")
    monkeypatch.setenv("DATAPARALLEL_CHECK_COLLECTIVES", "1")
    assert launcher_settings(None, None) == (42.0, True)
    assert launcher_settings(5.0, False) == (5.0, False)  # arguments win

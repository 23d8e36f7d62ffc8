"""Bad input to `dataparallel train`: one line naming the field and the fix, exit 2, nothing
written, no worker started.

The cases run `cli.main` in this process (the checks happen before any launch, so this is the
code path of the real command, and it takes milliseconds); one case runs the real command in a
subprocess to check the exit status and stderr as a shell sees them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dataparallel.cli import main

from .helpers import CORPUS, refused_in_one_line


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _npy(path: Path, ids: list[int]) -> Path:
    import numpy as np

    np.save(path, np.array(ids, dtype=np.uint16))
    return path


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


CASES = {
    # name: (extra args, a setup function of tmp_path returning more args, expected fragments)
    "an unknown recovery": (
        ["--recovery", "later"],
        None,
        ["--recovery (launch.recovery)", "unknown value 'later'", "choose one of restart, live"],
    ),
    "live recovery of a sharded strategy": (
        ["--recovery", "live", "--strategy", "zero3"],
        None,
        ["--recovery (launch.recovery)", "does not cover strategy yet", "use --strategy ddp"],
    ),
    "a live run whose maximum is below its workers": (
        ["--recovery", "live", "--nproc", "2", "--max-replicas", "1"],
        None,
        ["--max-replicas (launch.max_replicas)", "1 is below --nproc 2", "or 0 for --nproc"],
    ),
    "tp does not divide the ranks": (
        ["--nproc", "3", "--tp", "2"],
        None,
        ["--tp (launch.tp)", "2 does not divide the 3 ranks", "use a divisor"],
    ),
    "tp does not divide the heads": (
        ["--nproc", "8", "--tp", "8"],
        None,
        ["--tp (launch.tp)", "8 does not divide gpt-tiny's 4 heads", "use a divisor of 4"],
    ),
    "tp of a Hugging Face model": (
        ["--tp", "2", "--model", "hf:some/dir"],
        None,
        ["--tp (launch.tp)", "hf:some/dir has no tensor-parallel plan", "or --tp 1"],
    ),
    "tp of a model without a plan": (
        ["--tp", "2", "--model", "mlp"],
        None,
        ["--tp (launch.tp)", "mlp has no tensor-parallel plan", "use a reference GPT"],
    ),
    "tp below 1": (["--tp", "0"], None, ["--tp (launch.tp)", "0 is below 1"]),
    "global batch leaves a micro-batch empty": (
        ["--global-batch", "3", "--accum", "2"],
        None,
        [
            "--global-batch (train.global_batch)",
            "3 windows leave some of the accum 2 x 2 ranks = 4 micro-batches empty",
            "use at least 4 windows, or a smaller --accum",
        ],
    ),
    "more ranks than samples": (
        ["--nproc", "4", "--block-size", "32"],
        lambda tmp: ["--data", str(_write(tmp / "small.txt", "x" * 100))],
        ["--nproc (launch.nproc)", "4 ranks but only 2 training windows", "use fewer workers"],
    ),
    "unknown model": (
        ["--model", "gpt-huge"],
        None,
        [
            "--model (model.name)",
            "unknown value 'gpt-huge'",
            "gpt-medium, gpt-small, gpt-tiny, mlp",
        ],
    ),
    "unknown strategy": (
        ["--strategy", "zero9"],
        None,
        ["--strategy (launch.strategy)", "unknown value 'zero9'", "choose one of ddp"],
    ),
    "negative collective timeout": (
        ["--collective-timeout", "-1"],
        None,
        ["--collective-timeout (launch.collective_timeout)", "-1.0 is below 0", "use 0 or more"],
    ),
    "trace that does not parse": (
        ["--trace", "ten-12"],
        None,
        ["--trace (train.trace)", "'ten-12' is not a step or a range", "e.g. --trace 10-12"],
    ),
    "trace past the last step": (
        ["--trace", "4-9", "--steps", "8"],
        None,
        ["--trace (train.trace)", "past the run's last step (8)", "between 1 and 8"],
    ),
    "unreadable data path": (
        [],
        lambda tmp: ["--data", str(tmp / "missing")],
        ["--data (data.paths)", "missing does not exist", "give readable files or folders"],
    ),
    "data folder without text": (
        [],
        lambda tmp: ["--data", str(_folder(tmp / "empty"))],
        ["--data (data.paths)", "holds no readable text file"],
    ),
    "jsonl line without the field": (
        [],
        lambda tmp: [
            "--data",
            str(_write(tmp / "d.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')),
        ],
        [
            "--data (data.paths)",
            'd.jsonl line 2 has no "completion" field',
            'give every record of the file a "completion"',
        ],
    ),
    "jsonl line far into the file without the field": (
        [],
        lambda tmp: [
            "--data",
            str(
                _write(
                    tmp / "late.jsonl",
                    '{"prompt": "a", "completion": "b"}\n' * 150 + '{"prompt": "c"}\n',
                )
            ),
        ],
        ["--data (data.paths)", 'late.jsonl line 151 has no "completion" field'],
    ),
    "chat data without a chat template": (
        [],
        lambda tmp: [
            "--data",
            str(_write(tmp / "c.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n')),
        ],
        ["--data (data.paths)", "c.jsonl holds chat messages but the tokenizer has no chat"],
    ),
    "unreadable parquet": (
        [],
        lambda tmp: ["--data", str(_write(tmp / "p.parquet", "not parquet"))],
        ["--data (data.paths)", "p.parquet is not a readable Parquet file"],
    ),
    "token file outside the vocabulary": (
        [],
        lambda tmp: ["--data", str(_npy(tmp / "t.npy", [1, 2, 300, 4]))],
        [
            "--data (data.paths)",
            "t.npy holds id 300 at position 2, outside the tokenizer's vocabulary of 256",
            "tokenize the data with the model's tokenizer",
        ],
    ),
    "unknown token dtype": (
        ["--token-dtype", "int8"],
        None,
        ["--token-dtype (data.token_dtype)", "unknown value 'int8'", "auto, uint16, uint32"],
    ),
    "output directory holds another run": (
        [],
        lambda tmp: ["--out", str(_write(tmp / "old" / "config.toml", "").parent)],
        [
            "--out (launch.out)",
            "holds another run (config.toml)",
            "continue that run with --resume",
        ],
    ),
    "unknown precision": (
        ["--precision", "fp8"],
        None,
        [
            "--precision (train.precision)",
            "unknown value 'fp8'",
            "choose one of bf16, bf16-params, fp16, fp32",
        ],
    ),
    "shard group that does not divide the ranks": (
        ["--strategy", "zero3", "--shard-group", "3"],
        None,
        ["--shard-group (launch.shard_group)", "3 does not divide the 2 ranks", "use a divisor"],
    ),
    "shard group with ddp": (
        ["--shard-group", "2"],
        None,
        ["--shard-group (launch.shard_group)", "ddp replicates everything", "use zero1, zero2"],
    ),
    "window longer than the model's context": (
        ["--block-size", "512"],
        None,
        ["--block-size (data.block_size)", "exceeds gpt-tiny's context of 128", "at most 128"],
    ),
    "learning rate that is not a number": (
        ["--lr", "inf"],
        None,
        ["--lr (optim.lr)", "inf is not a positive number"],
    ),
    "gradient clip that is not a number": (
        ["--grad-clip", "nan"],
        None,
        ["--grad-clip (optim.grad_clip)", "nan is not a finite number"],
    ),
    "typo in the config file": (
        [],
        lambda tmp: ["--config", str(_write(tmp / "c.toml", "[train]\nstpes = 3\n"))],
        ["train.stpes", "unknown key", "did you mean train.steps?"],
    ),
    "powersgd rank larger than any matrix allows": (
        ["--compress", "powersgd:rank=500"],
        None,
        ["--compress (sync.compress)", "rank=500 exceeds", "at most 144", "use rank <= 144"],
    ),
    "top-k ratio outside (0, 1]": (
        ["--compress", "topk:ratio=1.5"],
        None,
        ["--compress (sync.compress)", "ratio=1.5 must be in (0, 1]"],
    ),
    "unknown compressor": (
        ["--compress", "zip"],
        None,
        ["--compress (sync.compress)", "unknown compressor 'zip'", "powersgd:rank=4"],
    ),
    "unknown compressor option": (
        ["--compress", "int8:bits=4"],
        None,
        ["--compress (sync.compress)", "unknown option 'bits=4'", "options are block, start"],
    ),
    "bf16 compression of bf16 gradients": (
        ["--compress", "bf16", "--precision", "bf16-params"],
        None,
        ["--compress (sync.compress)", "already bf16", "int8, topk or powersgd"],
    ),
    "compression under DiLoCo": (
        ["--compress", "int8", "--diloco", "10"],
        None,
        ["--compress (sync.compress)", "only inside a replica", "--outer-compress"],
    ),
    "local SGD every 0 steps is off, below is an error": (
        ["--local-sgd", "-1"],
        None,
        ["--local-sgd (sync.local_sgd)", "-1 is below 1", "H >= 1"],
    ),
    "both local SGD and DiLoCo": (
        ["--local-sgd", "4", "--diloco", "4"],
        None,
        ["--diloco (sync.diloco)", "choose one"],
    ),
    "outer compression without DiLoCo": (
        ["--outer-compress", "int8"],
        None,
        ["--outer-compress (sync.outer_compress)", "only DiLoCo has outer gradients"],
    ),
    "outer momentum of 1": (
        ["--diloco", "5", "--outer-momentum", "1"],
        None,
        ["--outer-momentum (sync.outer_momentum)", "outside [0, 1)"],
    ),
    "fragments that do not divide H": (
        ["--diloco", "8", "--fragments", "3"],
        None,
        ["--fragments (sync.fragments)", "fragments=3 must divide every=8"],
    ),
    "fragments without DiLoCo": (
        ["--fragments", "2"],
        None,
        ["--fragments (sync.fragments)", "only DiLoCo streams fragments"],
    ),
    "an overlap as long as a fragment's turn": (
        ["--diloco", "8", "--fragments", "2", "--overlap", "4"],
        None,
        ["--overlap (sync.overlap)", "must be below every / fragments = 4"],
    ),
    "resume of a directory without a run": (
        [],
        lambda tmp: ["--resume", str(tmp)],
        ["--resume", "holds no run (no config.toml)"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(name, tmp_path, monkeypatch, capsys):
    args, setup, fragments = CASES[name]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the default run directory would appear under work/runs
    args = args + (setup(tmp_path) if setup else [])
    if "--data" not in args:
        args = ["--data", str(CORPUS), *args]
    refused_in_one_line(args, tmp_path, capsys, fragments)


def test_the_real_command_exits_2_with_one_line(tmp_path):
    command = [sys.executable, "-m", "dataparallel.cli", "train", "--model", "gpt-huge"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "dataparallel train: error: --model (model.name): unknown value 'gpt-huge'; choose one "
        "of gpt-medium, gpt-small, gpt-tiny, mlp, or hf:DIR"
    ]
    assert list(tmp_path.iterdir()) == []


def test_unknown_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--stpes", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --stpes 3" in err

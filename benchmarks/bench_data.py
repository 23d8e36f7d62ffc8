"""What `--data` costs: tokenization (cold, then from the cache) and data loading per step.

    .venv/bin/python benchmarks/bench_data.py --megabytes 2 --steps 20

Builds, in a temporary folder, a text corpus (the first --megabytes of the standard library's
sources, as files) and a JSONL file of prompt/completion records cut from the same text (a
line as the prompt, the next as the completion). For each with the byte tokenizer and with a
byte-level BPE tokenizer trained here (tests/hf_fixtures.py, 384 ids):
- cold: `load_datasets` with no cache (tokenize, write the cache, map it);
- cached: `load_datasets` again (hash the files, map the cache);
- data per step: this rank's sample indices and `batch()` for --batch windows of --block
  tokens, the trainer's "data" phase without its all-reduce;
- step: a whole training step of gpt-tiny (with the tokenizer's vocabulary) on those windows in
  one process: data, forward, backward, AdamW; the share is data / step.
Medians of --steps steps after 3 warm-up steps. One process, --threads torch threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from dataparallel.data.cache import CACHE_DIR  # noqa: E402
from dataparallel.data.corpus import stdlib_files  # noqa: E402
from dataparallel.data.loading import load_datasets  # noqa: E402
from dataparallel.data.packing import IGNORE  # noqa: E402
from dataparallel.data.stream import SampleStream  # noqa: E402
from dataparallel.data.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from dataparallel.models import build_model  # noqa: E402


def make_data(folder: Path, megabytes: float) -> tuple[Path, Path]:
    """A folder of text files and a JSONL file, each about `megabytes` MB."""
    text_dir = folder / "text"
    text_dir.mkdir()
    budget, lines = int(megabytes * 1e6), []
    for i, source in enumerate(stdlib_files()):
        data = source.read_bytes()
        (text_dir / f"{i:05d}.py").write_bytes(data)
        lines += source.read_text(errors="replace").splitlines()
        budget -= len(data)
        if budget <= 0:
            break
    records = [
        {"prompt": lines[i] + "\n", "completion": lines[i + 1] + "\n"}
        for i in range(0, len(lines) - 1, 2)
    ]
    jsonl = folder / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    return text_dir, jsonl


def timed_load(path: Path, tokenizer, block: int):
    started = time.perf_counter()
    windows = load_datasets([str(path)], tokenizer, block, 0.05)
    return time.perf_counter() - started, windows


def step_times(train, tokenizer, args) -> tuple[float, float]:
    """Median (data, whole step) seconds of training gpt-tiny on `train`."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", vocab_size=tokenizer.vocab_size, block_size=args.block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = SampleStream(len(train), seed=0)
    data_s, step_s = [], []
    for step in range(args.steps + 3):
        started = time.perf_counter()
        inputs, targets = train.batch(samples.take(args.batch, 0, 1))
        counted = int((targets != IGNORE).sum())
        loaded = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        ) / max(counted, 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 3:
            data_s.append(loaded - started)
            step_s.append(time.perf_counter() - started)
    return statistics.median(data_s), statistics.median(step_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=2.0, help="size of each data set")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps")
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--block", type=int, default=128, help="tokens per window")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from hf_fixtures import make_tokenizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        text_dir, jsonl = make_data(folder, args.megabytes)
        tokenizers = {
            "bytes": ByteTokenizer(),
            "BPE-384": HFTokenizer.load(make_tokenizer(folder / "tok")),
        }
        for data_name, path in [("text", text_dir), ("jsonl p/c", jsonl)]:
            size = sum(
                f.stat().st_size
                for f in ([path] if path.is_file() else path.iterdir())
                if f.is_file()
            )
            for tok_name, tokenizer in tokenizers.items():
                for cache in folder.rglob(CACHE_DIR):
                    for entry in cache.iterdir():
                        entry.unlink()
                cold, _ = timed_load(path, tokenizer, args.block)
                cached, (train, _, info) = timed_load(path, tokenizer, args.block)
                data_s, step_s = step_times(train, tokenizer, args)
                rows.append(
                    f"| {data_name} | {tok_name} | {size / 1e6:.2f} MB | {info.num_tokens / 1e6:.2f}M "
                    f"({100 * info.target_tokens / info.num_tokens:.0f}% targets) | {cold:.2f} s | "
                    f"{cached:.3f} s | {1e3 * data_s:.2f} ms | {1e3 * step_s:.0f} ms | "
                    f"{100 * data_s / step_s:.2f}% |"
                )
                print(rows[-1], flush=True)
    print()
    print(
        "| data | tokenizer | size | tokens | tokenize, cold | load, cached | data/step | "
        "step | data share |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

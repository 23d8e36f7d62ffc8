"""Two hosts on a shaped 100 Mbit/s link (network namespaces, benchmarks/two_hosts.py): the real
`dataparallel train --nnodes 2`, exact and int8-compressed, one node per namespace.

Checks: both nodes finish; the link really is slow (an exact step of gpt-tiny moves 4.2 MB per
rank, at least 0.34 s at 100 Mbit/s); int8 sends under 40% of the exact bytes and trains to a
validation loss within 2% of the exact run's; the namespaces are gone afterwards, also after a
run whose workers fail.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
two_hosts = pytest.importorskip("two_hosts")

REASON = two_hosts.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two hosts: {REASON}")
ARGS = ["--model", "gpt-tiny", "--steps", "6", "--eval-every", "0", "--threads", "1"]


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("dp")}


def _train(out: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    node0, node1, output, _ = two_hosts.train_on_two_hosts([*ARGS, *extra], str(out))
    assert (node0, node1) == (0, 0), output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "val"]


def test_exact_and_int8_training_across_two_namespaces(tmp_path):
    before = _namespaces()
    exact, exact_val = _train(tmp_path / "exact")
    int8, int8_val = _train(tmp_path / "int8", "--compress", "int8")
    assert _namespaces() == before  # everything created was removed
    exact_bytes = statistics.median(r["bytes_sent"] for r in exact)
    int8_bytes = statistics.median(r["bytes_sent"] for r in int8)
    assert exact_bytes > 4.2e6  # 1.06M fp32 gradients all-reduced
    assert int8_bytes < 0.4 * exact_bytes
    # The shaping works: 4.2 MB cannot cross 100 Mbit/s in under 0.34 s.
    assert statistics.median(r["step_time_s"] for r in exact[1:]) > 0.34
    assert int8_val[-1]["val_loss"] < exact_val[-1]["val_loss"] * 1.02


def test_a_failed_run_leaves_no_namespace(tmp_path):
    before = _namespaces()
    node0, node1, output, _ = two_hosts.train_on_two_hosts(
        [*ARGS, "--compress", "topk:ratio=2"], str(tmp_path / "bad")
    )
    assert node0 == node1 == 2 and "ratio=2.0 must be in (0, 1]" in output
    assert _namespaces() == before

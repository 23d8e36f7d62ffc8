"""Live recovery under --compress powersgd (docs/faults.md, "Live recovery"): a worker killed
with SIGKILL in the middle of a 3-rank run; the survivors rewind the step with their
compression state, a replacement receives the run's shared PowerSGD factors and `rounds` and
starts its own residual at zero ([Note: compression across replicas] in compression/live.py).
"""

from __future__ import annotations

import pytest

from dataparallel.train.metrics import read_metrics

from .helpers import (
    LIVE_ARGS,
    LIVE_STEPS,
    check_generations,
    kill_during_a_live_run,
    max_difference,
    ok,
    train,
    train_steps,
)

COMPRESSED = [*LIVE_ARGS, "--compress", "powersgd:rank=2"]


@pytest.fixture(scope="module")
def compressed_reference(tmp_path_factory):
    """The uninterrupted run with the same flags, on one rank with the whole global batch:
    PowerSGD's sums are linear in the ranks' buckets, so the ranks' split changes only the
    summation order (the sum of the ranks' residuals is the one rank's)."""
    out = tmp_path_factory.mktemp("compressed_reference") / "run"
    ok(train([*COMPRESSED, "--nproc", "1", "--batch", "12"], out))
    return out


def _last_val_loss(run) -> float:
    return [r["val_loss"] for r in read_metrics(run) if r["kind"] == "val"][-1]


def test_a_killed_worker_under_powersgd_is_replaced_and_the_run_stays_close(
    tmp_path, compressed_reference
):
    out = tmp_path / "live"
    first, _, stderr = kill_during_a_live_run(out, slot=1, args=COMPRESSED)
    joined_at = check_generations(stderr, first, slot=1)
    assert train_steps(out) == list(range(1, LIVE_STEPS + 1))  # every step once
    # Not equal: the lost replica's residual is gone with it (what PowerSGD had held back of
    # its gradients). Measured in 3 runs (printed with -s): max |difference| 1.45e-2, val loss
    # +0.22-0.23 %. Summation order alone (3 or 2 ranks uninterrupted) gives 1.0e-3 to
    # 1.2e-3; an uninterrupted 3-rank run whose rank 1 drops its residual at the killed step
    # differs from the live run by 4.2e-4: the lost residual is all of the rest.
    difference = max_difference(out, compressed_reference)
    ours, theirs = _last_val_loss(out), _last_val_loss(compressed_reference)
    print(
        f"max |live - uninterrupted| = {difference:.2e}, val loss {ours:.5f} against "
        f"{theirs:.5f}, replacement joined at step {joined_at}"
    )
    assert difference < 3e-2, difference
    assert abs(ours - theirs) < 0.005 * theirs, (ours, theirs)

"""The harness's rank 0 hosts the store: it stays until every rank has ended `fn`.

Rank 0 returns at once while the others still read the store half a second later (as a rank
still making a mesh's groups does after the others' last collective; CI met it as "Connection
reset by peer" in test_transform.py): each later read finds the store and its value.
"""

from __future__ import annotations

import time

from dataparallel.torch_internals import default_store

from .harness import run_world


def _late_readers(world):
    store = default_store()
    if world.rank == 0:
        store.set("harness-test/value", b"kept")
        return 0.0, b"kept"
    store.wait(["harness-test/value"])
    time.sleep(0.5)  # rank 0 has returned by now
    start = time.monotonic()
    value = store.get("harness-test/value")
    return time.monotonic() - start, value


def test_rank_0_keeps_the_store_until_every_rank_has_ended():
    results = run_world(3, _late_readers)
    assert len(results) == 3
    for waited, value in results:
        assert value == b"kept"
        assert waited < 5.0, waited

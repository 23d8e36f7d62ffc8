"""The launcher's HSDP replica over real child processes (moved from
tests/unit/test_membership.py, which keeps the quorum's pure logic)."""


def test_an_hsdp_replica_ends_as_a_whole():
    """[Note: HSDP replicas]: the launcher's Replica of S processes ends when one of them ends
    otherwise than with 0, and then its siblings are killed; all 0 is a finished replica."""
    import subprocess
    import sys
    import time

    from dataparallel.train.live.slots import Replica

    def start(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    lost = Replica([start("import time; time.sleep(60)"), start("raise SystemExit(3)")])
    deadline = time.monotonic() + 30
    while lost.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert lost.returncode == 3 and lost.processes[0].returncode == -9  # the sibling: killed
    done = Replica([start("pass"), start("pass")])
    assert done.wait(30) == 0 and done.pid == done.processes[0].pid

"""A worker of a live run that its launcher did not start (`dataparallel join`): its heartbeat,
and the launcher's handle on it ([Note: membership requests] in requests.py).

    heartbeat = Heartbeat(store, slot=3).start()     # the joiner, until it ends...
    heartbeat.stop(code)                                # ...then its exit status, for the launcher
    process = RemoteProcess(store, slot=3, pid=4242)      # the launcher: Popen's verbs
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from .store import beat_key, bye_key, signal_key

HEARTBEAT_S = 0.5  # how often a joiner beats
HEARTBEAT_TIMEOUT_S = 10.0  # beats missed this long: the joiner is taken for dead

SILENT = 1  # the exit status the launcher gives a joiner whose heartbeat stopped


class Heartbeat:
    """A joiner's side: beat every HEARTBEAT_S, raise in this process the signal the launcher
    sends, and leave the exit status for it when done.

    store: a connection to the launcher's store (under the run's prefix) for this thread alone.
    slot: the joiner's slot.
    """

    def __init__(self, store: dist.Store, slot: int):
        self.store, self.slot = store, slot
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def stop(self, code: int) -> None:
        """Stop beating and tell the launcher this process ends with status `code`."""
        self.done.set()
        self.thread.join()
        try:
            self.store.set(bye_key(self.slot), str(code))
        except RuntimeError:  # the launcher has gone already: nobody is left to tell
            pass

    def _beat(self) -> None:
        raised = None  # the last signal raised: the launcher may send SIGTERM, then SIGKILL
        while True:
            try:
                self.store.add(beat_key(self.slot), 1)
                if self.store.check([signal_key(self.slot)]):
                    number = int(self.store.get(signal_key(self.slot)))
                    if number != raised:
                        raised = number
                        if signal.getsignal(number) == signal.SIG_DFL:  # it ends this process
                            self.store.set(bye_key(self.slot), str(-number))  # as Popen says
                        os.kill(os.getpid(), number)  # else its handler runs; stop() tells
            except RuntimeError:  # the store is gone (DistError): so is the launcher, and the run
                print(
                    "dataparallel join: the run's launcher is gone; this worker stops",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            if self.done.wait(HEARTBEAT_S):
                return


class RemoteProcess:
    """The launcher's handle on a joiner: the verbs of subprocess.Popen that it uses, over the
    store. It has ended when it said so (`bye/<slot>`) or when its heartbeat has not moved for
    `timeout_s` (then with status SILENT).

    store: the store the launcher hosts (under the run's prefix).
    slot: the joiner's slot.
    pid: the joiner's process id, on its own machine (for messages only).
    """

    def __init__(
        self, store: dist.Store, slot: int, pid: int, timeout_s: float = HEARTBEAT_TIMEOUT_S
    ):
        self.store, self.slot, self.pid, self.timeout_s = store, slot, pid, timeout_s
        self.returncode: int | None = None
        self.beats, self.beat_at = 0, time.monotonic()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._ended()
        return self.returncode

    def _ended(self) -> int | None:
        if self.store.check([bye_key(self.slot)]):
            return int(self.store.get(bye_key(self.slot)))
        beats, now = self.store.add(beat_key(self.slot), 0), time.monotonic()
        if beats != self.beats:
            self.beats, self.beat_at = beats, now
            return None
        return SILENT if now - self.beat_at > self.timeout_s else None

    def send_signal(self, number: int) -> None:
        self.store.set(signal_key(self.slot), str(int(number)))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"replica {self.slot}", timeout)
            time.sleep(0.05)
        return self.returncode

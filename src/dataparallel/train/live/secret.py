"""A live run's secret, and the signed requests it lets in (docs/security.md).

    path = make_secret(run_dir)                         # the launcher, as the run starts
    key = RunKey.read(find_secret(run_dir, flag))       # dataparallel join / leave, a worker
    text = key.seal(request.to_json())                  # what a client writes into the store
    gate = Gate(key)                                    # the launcher: one per kind of request
    body = gate.open(text)                              # or Refused("replayed: ...")

[Note: signed requests] Anyone who reaches the store's port can write into it; the launcher
acts only on what was written by someone who holds the run's secret. The secret is 32 random
bytes (hex) in RUN_DIR/live.secret, mode 0600, written by the launcher when the run starts;
`dataparallel join`/`leave` read it there, or from the file named by --secret-file or by
DATAPARALLEL_SECRET_FILE (a Kubernetes Secret mounted as a file; the launcher then uses that
one too). A sealed message is JSON:
    {"body": the request's JSON, "nonce": 16 random bytes (hex), "time": Unix time,
     "mac": HMAC-SHA256(secret, JSON [purpose, body, nonce, time]) (hex)}
`purpose` binds a message to where it belongs (a quorum report to its key gen/<g>/report/<slot>,
so a copy under another generation's key does not verify); requests have none. The launcher
refuses, with one line in its log, a message that is not sealed ("unsigned"), whose MAC does
not match ("forged": another secret, or an altered body), whose time is more than VALID_S away
from its own clock ("expired"), or whose nonce it has seen within VALID_S ("replayed": a
recorded request written again). A fresh nonce is remembered for VALID_S, so the memory stays
bounded; older messages are refused by their time. A quorum report is read again on every poll
of its generation, so it is checked for its MAC and key, not for freshness.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..config import ConfigError

SECRET_FILE = "live.secret"  # in the run directory, mode 0600
ENV_SECRET_FILE = "DATAPARALLEL_SECRET_FILE"  # a file that holds the secret (a k8s Secret)
SECRET_BYTES = 32
VALID_S = 60.0  # how far a request's time may be from the launcher's clock
REASONS = ("unsigned", "forged", "expired", "replayed")


class Refused(Exception):
    """A message the run's key does not let in; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# -- the secret's file ----------------------------------------------------------------------------
def make_secret(run_dir: Path) -> Path:
    """Write a fresh secret into RUN_DIR/live.secret, readable by its owner only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SECRET_FILE
    path.unlink(missing_ok=True)  # a file left by an earlier run may have other modes
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(handle, "w") as out:
        out.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def find_secret(run_dir: Path, given: str | None = None) -> Path:
    """Where the secret is: `given` (--secret-file), else $DATAPARALLEL_SECRET_FILE, else
    RUN_DIR/live.secret."""
    return Path(given or os.environ.get(ENV_SECRET_FILE) or run_dir / SECRET_FILE)


class RunKey:
    """The run's secret, which seals messages and checks them ([Note: signed requests]).

    secret: the secret's bytes (at least 16).
    """

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError(f"RunKey: a secret of {len(secret)} bytes is too short (16 or more)")
        self.secret = secret

    @classmethod
    def read(cls, path: Path) -> RunKey:
        """The secret in `path` (its text, stripped); ConfigError naming the file and the fix."""
        try:
            text = path.read_text().strip()
        except OSError as error:
            raise ConfigError(
                "--secret-file",
                f"cannot read the run's secret from {path} ({error.strerror})",
                f"run as the user who started the run, or give its secret with --secret-file "
                f"or {ENV_SECRET_FILE}",
            ) from None
        if len(text) < 16:
            raise ConfigError(
                "--secret-file", f"{path} holds {len(text)} characters", "give 16 or more"
            )
        return cls(text.encode())

    def mac(self, purpose: str, body: str, nonce: str, sent: float) -> str:
        message = json.dumps([purpose, body, nonce, sent]).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def seal(self, body: str, purpose: str = "", now: float | None = None) -> str:
        """`body` as a sealed message: with a fresh nonce, the time and their MAC."""
        nonce, sent = secrets.token_hex(16), time.time() if now is None else now
        mac = self.mac(purpose, body, nonce, sent)
        return json.dumps({"body": body, "nonce": nonce, "time": sent, "mac": mac})

    def verify(self, text: str | bytes, purpose: str = "") -> dict:
        """The sealed message in `text`, its MAC checked (not its time); Refused otherwise."""
        try:
            sealed = json.loads(text)
            body, nonce, sent, mac = (sealed[k] for k in ("body", "nonce", "time", "mac"))
            if not (isinstance(body, str) and isinstance(nonce, str) and isinstance(mac, str)):
                raise TypeError("a field of the wrong type")
            sent = float(sent)
        except (ValueError, TypeError, KeyError) as error:
            raise Refused("unsigned", f"not a sealed message ({error})") from None
        if not hmac.compare_digest(self.mac(purpose, body, nonce, sent), mac):
            raise Refused("forged", "its MAC does not match the run's secret")
        return {"body": body, "nonce": nonce, "time": sent}


class Gate:
    """The launcher's check of fresh requests: MAC, time and nonce; counts what it refused.

    key: the run's key.
    valid_s: how far a request's time may be from now, and how long a nonce is remembered.
    clock: the time (time.time; a test's own).
    """

    def __init__(
        self, key: RunKey, valid_s: float = VALID_S, clock: Callable[[], float] = time.time
    ):
        self.key, self.valid_s, self.clock = key, valid_s, clock
        self.seen: dict[str, float] = {}  # nonce -> when it expires
        self.refused: Counter[str] = Counter()  # by reason

    def open(self, text: str | bytes) -> str:
        """The body of a fresh, authentic request; Refused (and counted) otherwise."""
        try:
            sealed = self.key.verify(text)
            now = self.clock()
            if abs(now - sealed["time"]) > self.valid_s:
                raise Refused(
                    "expired",
                    f"sent {now - sealed['time']:+.0f} s from now (at most {self.valid_s:g} s)",
                )
            self.seen = {n: until for n, until in self.seen.items() if until > now}
            if sealed["nonce"] in self.seen:
                raise Refused("replayed", f"nonce {sealed['nonce'][:8]}... was used already")
            self.seen[sealed["nonce"]] = now + 2 * self.valid_s  # past any time still valid
            return sealed["body"]
        except Refused as refused:
            self.refused[refused.reason] += 1
            raise

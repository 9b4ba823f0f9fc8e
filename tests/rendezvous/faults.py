"""``FaultyStore``: an ObjectStore that fails backend calls by rule, below its own retry loop.

Faults are decided by a seeded hash of (operation, key), never by timing, so a run injects the same faults
whatever the interleaving of its threads:

* ``fraction``: the first attempt of that share of (operation, key) pairs raises a transient error before
  reaching the backend; the retry succeeds.
* ``lost_fraction``: the first attempt of that share of writes reaches the backend and succeeds, then
  raises as if the response had been lost; the retry finds the object already there.
* ``fail_on``: every call on a matching key fails permanently (PermissionError), e.g. to stop one
  replica's uploads in one round.
* ``kill_on``: the process SIGKILLs itself at the first call on a matching key: a deterministic kill -9.
* ``hold``: {pattern: file}: calls on a key matching a pattern wait until its file exists, so a test can
  order events across processes (hold the survivors until a restarted replica is back) without timing.
* ``outage``: [start file, end file]: while the first exists and the second does not, every write fails as
  a full disk does (ENOSPC), before reaching the backend: a store outage the test switches on and off.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from composer_serverless.rendezvous.retry import RetryPolicy
from composer_serverless.rendezvous.store import ObjectStore

T = TypeVar("T")
_WRITES = ("put", "create")


class InjectedFault(ConnectionResetError):
    """A transient fault injected by FaultyStore."""


class FaultyStore(ObjectStore):
    def __init__(
        self,
        url: str,
        *,
        fraction: float = 0.0,
        lost_fraction: float = 0.0,
        seed: int = 0,
        fail_on: str | None = None,
        kill_on: str | None = None,
        hold: dict[str, str] | None = None,
        outage: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(url, retry=RetryPolicy(attempts=4, first_s=0.01, cap_s=0.05))
        self.fraction = fraction
        self.lost_fraction = lost_fraction
        self.seed = seed
        self.fail_on = re.compile(fail_on) if fail_on else None
        self.kill_on = re.compile(kill_on) if kill_on else None
        self.hold = [(re.compile(pattern), release) for pattern, release in (hold or {}).items()]
        self.outage = outage
        # Keys are drawn relative to this root, so the same keys fail wherever the test's tmp dir is.
        self._base = self._root
        # Shared by child stores (copy.copy), so counts are per process.
        self.tried: dict[tuple[str, str], int] = {}
        self.injected: list[str] = []
        self._lock = threading.Lock()

    def _attempt(self, op: str, key: str, fn: Callable[[], T]) -> T:
        where = f"{self._root}/{key}" if key else self._root
        where = where[len(self._base) :].lstrip("/")
        if self.kill_on and self.kill_on.search(where):
            os.kill(os.getpid(), signal.SIGKILL)
        for pattern, release in self.hold:
            while pattern.search(where) and not os.path.exists(release):
                time.sleep(0.02)
        if (
            self.outage
            and op in ("put", "create", "delete")
            and os.path.exists(self.outage[0])
            and not os.path.exists(self.outage[1])
        ):
            raise OSError(errno.ENOSPC, f"injected outage: no space left for {op} {where}")
        with self._lock:
            attempt = self.tried.get((op, where), 0)
            self.tried[(op, where)] = attempt + 1
        if self.fail_on and self.fail_on.search(where):
            raise PermissionError(f"injected permanent fault in {op} {where}")
        if attempt == 0 and self._draw("transient", op, where) < self.fraction:
            self.injected.append(f"{op} {where}")
            raise InjectedFault(f"injected transient fault in {op} {where}")
        if attempt == 0 and op in _WRITES and self._draw("lost", op, where) < self.lost_fraction:
            fn()
            self.injected.append(f"lost {op} {where}")
            raise InjectedFault(f"injected lost response after {op} {where} succeeded")
        return fn()

    def _draw(self, kind: str, op: str, where: str) -> float:
        digest = hashlib.sha256(f"{self.seed}:{kind}:{op}:{where}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

"""Log lines that say which replica they are about: ``[replica 3] round 4/36 ...``.

Replicas of one run can share a process (tests, in-process replays), and then the prefix is what tells their
lines apart; in a replica's own process (its own log file) it is the same prefix on every line. The prefix is
added here, once, by a ``logging.LoggerAdapter``: the worker's log format does not repeat it, and no call
spells it out by hand.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class ReplicaLog(logging.LoggerAdapter):
    """``logger``'s records, each message prefixed with ``[replica {rank}]``, or ``[replica {rank}.{local}]``
    in a replica of several ranks (whose ranks share its log)."""

    def __init__(self, logger: logging.Logger, rank: int, local: int | None = None) -> None:
        super().__init__(logger, {"replica": rank if local is None else f"{rank}.{local}"})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        assert self.extra is not None
        return f"[replica {self.extra['replica']}] {msg}", kwargs

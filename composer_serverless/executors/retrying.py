"""Calls to a backend's API that say what went wrong: retried while the failure is transient, and otherwise
turned into a ``BackendError`` naming the cause and the fix.

A backend (HF Jobs, Modal) classifies its client's exceptions into ``Refusal``s; ``call`` retries the
transient ones (rate limits, server errors, the network) with jittered exponential backoff, honouring a
server's ``Retry-After``, for up to a budget of seconds, and raises the rest at once: a rejected token or a
missing credit does not get better by asking again. The budget is a deadline, not a count, so a client that
retries inside each attempt (``huggingface_hub`` does for listings) does not multiply the wait.

A spell of retries is summarised, not narrated: one line when it starts (what failed, for how long it will be
retried) and one when it ends well (after how many retries and seconds); one that outlasts its budget ends in
the ``BackendError``, which says the same. A minute of 429s is two lines, not one per attempt.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TypeVar

from composer_serverless.executors.base import BackendError

logger = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0


@dataclass(frozen=True)
class Refusal:
    """What a failed API call means: the message (cause and fix), whether asking again may help, and how
    long the server asked us to wait first."""

    message: str
    transient: bool
    retry_after_s: float | None = None


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header in seconds: delay-seconds (a fraction too, as some servers send and the
    ``openai`` client reads) or an HTTP date (RFC 9110 10.2.3); None if absent or unreadable. ``now`` is
    ``time.time()`` by default."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, OverflowError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


class Backoff:
    """One operation's retries: how long the next wait is, and whether the budget still allows it."""

    def __init__(self, budget_s: float, what: str, sleep: Callable[[float], None] = time.sleep) -> None:
        self.budget_s = budget_s
        self.what = what
        self.retries = 0
        self._started = time.monotonic()
        self._deadline = self._started + budget_s
        self._delay = FIRST_DELAY_S
        self._sleep = sleep

    def wait(self, refusal: Refusal) -> None:
        """Wait before the next try, as long as the server asked (``Retry-After``) or the backoff says.

        Raises:
            BackendError: the refusal is not transient (exit 2), or waiting would outlast the budget (exit 1):
                a retry sooner than the server asked would only be refused again.
        """
        if not refusal.transient:
            raise BackendError(refusal.message, 2) from None
        if refusal.retry_after_s is not None:
            wait = refusal.retry_after_s
        else:
            wait = self._delay * random.uniform(0.5, 1.0)
        if time.monotonic() + wait > self._deadline:
            raise BackendError(
                f"{refusal.message}\n  (still failing after {_retries(self.retries)} in {self._elapsed_s():.0f} s "
                f"while {self.what}; the budget is {self.budget_s:g} s)",
                1,
            ) from None
        if self.retries == 0:
            logger.warning(
                "%s: %s; retrying for up to %g s", self.what, refusal.message.splitlines()[0], self.budget_s
            )
        else:
            logger.debug("%s: retry %d in %.1f s", self.what, self.retries + 1, wait)
        self.retries += 1
        self._sleep(wait)
        self._delay = min(MAX_DELAY_S, self._delay * 2)

    def succeeded(self) -> None:
        """The call went through: close a spell of retries with its one line."""
        if self.retries:
            logger.warning(
                "%s: went through after %s in %.0f s", self.what, _retries(self.retries), self._elapsed_s()
            )

    def _elapsed_s(self) -> float:
        return time.monotonic() - self._started


def _retries(count: int) -> str:
    return f"{count} retr{'y' if count == 1 else 'ies'}"


def call(
    fn: Callable[[], T],
    classify: Callable[[Exception], Refusal | None],
    *,
    budget_s: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``, retried while its failure is transient and the budget lasts.

    Raises:
        BackendError: exit code 2 for a refusal the user must fix, 1 for a transient one that outlasted
            ``budget_s`` seconds. An exception ``classify`` does not recognise propagates unchanged.
    """
    backoff = Backoff(budget_s, what, sleep)
    while True:
        try:
            result = fn()
        except Exception as e:
            refusal = classify(e)
            if refusal is None:
                raise
            backoff.wait(refusal)
        else:
            backoff.succeeded()
            return result

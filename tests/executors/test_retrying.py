"""API calls retried while the failure is transient, as long as the server asks and the budget allows."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from email.utils import format_datetime

import pytest

from composer_serverless.executors.base import BackendError
from composer_serverless.executors.retrying import Refusal, call, retry_after_s


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert retry_after_s("7", now=now) == 7.0
    in_five = format_datetime(datetime.fromtimestamp(now + 5, timezone.utc), usegmt=True)
    assert retry_after_s(in_five, now=now) == 5.0
    past = format_datetime(datetime.fromtimestamp(now - 60, timezone.utc), usegmt=True)
    assert retry_after_s(past, now=now) == 0.0
    assert (
        retry_after_s("soon", now=now) is None and retry_after_s(None) is None and retry_after_s(" ") is None
    )


class Flaky:
    """Fails with ``errors`` in turn, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def _classify(e: Exception) -> Refusal | None:
    if isinstance(e, TimeoutError):
        return Refusal("slow down\n  fix: wait", transient=True, retry_after_s=float(str(e)))
    if isinstance(e, PermissionError):
        return Refusal("no\n  fix: a token", transient=False)
    if isinstance(e, ConnectionError):
        return Refusal("cannot reach\n  fix: the network", transient=True)
    return None


def test_a_transient_failure_waits_as_long_as_the_server_asked_then_succeeds() -> None:
    slept: list[float] = []
    fn = Flaky(TimeoutError("3"), TimeoutError("0.5"))
    assert call(fn, _classify, budget_s=60, what="asking", sleep=slept.append) == "ok"
    assert slept == [3.0, 0.5] and fn.calls == 3


def test_without_retry_after_the_waits_back_off_with_jitter() -> None:
    slept: list[float] = []
    fn = Flaky(ConnectionError(), ConnectionError(), ConnectionError())
    assert call(fn, _classify, budget_s=60, what="asking", sleep=slept.append) == "ok"
    assert 0.5 <= slept[0] <= 1.0 and 1.0 <= slept[1] <= 2.0 and 2.0 <= slept[2] <= 4.0


def test_a_refusal_to_fix_is_not_retried_and_exits_2() -> None:
    slept: list[float] = []
    fn = Flaky(PermissionError())
    with pytest.raises(BackendError, match="no") as e:
        call(fn, _classify, budget_s=60, what="asking", sleep=slept.append)
    assert e.value.exit_code == 2 and fn.calls == 1 and slept == []


def test_a_wait_the_budget_cannot_cover_is_not_taken_and_exits_1() -> None:
    """A retry sooner than the server asked would only be refused again: give up with the message."""
    slept: list[float] = []
    fn = Flaky(TimeoutError("30"))
    with pytest.raises(
        BackendError, match=r"still failing after 0 retries in 0 s while asking; the budget is 10 s"
    ) as e:
        call(fn, _classify, budget_s=10, what="asking", sleep=slept.append)
    assert e.value.exit_code == 1 and slept == [] and fn.calls == 1


def test_an_error_that_is_not_the_apis_propagates_unchanged() -> None:
    with pytest.raises(KeyError):
        call(Flaky(KeyError("x")), _classify, budget_s=60, what="asking", sleep=lambda s: None)


def test_a_spell_of_retries_is_two_lines_of_log_whatever_its_length(caplog) -> None:
    """Forty rate-limited answers, then one that goes through: one line when the spell starts, one when it
    ends, none per attempt (a minute of 429s used to print a line per retry, each twice)."""
    caplog.set_level(logging.DEBUG, logger="composer_serverless.executors.retrying")
    fn = Flaky(*[TimeoutError("1")] * 40)
    assert call(fn, _classify, budget_s=60, what="listing", sleep=lambda s: None) == "ok"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "listing: slow down; retrying for up to 60 s",
        "listing: went through after 40 retries in 0 s",
    ]

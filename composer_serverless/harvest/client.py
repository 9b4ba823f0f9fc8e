"""One teacher asked over HTTP: ``POST {base_url}/chat/completions`` with httpx's async client, under the
teacher's concurrency limit, the cap (``costs.Budget``), timeouts and retries.

Retries follow the ``openai`` client's rules (``openai/_base_client.py``), so a teacher behaves here as it
does under the official SDK: 408, 409, 429 and 5xx are retried, and so are connection failures, timeouts and
answers that are not a chat completion; ``x-should-retry`` overrules the status; the wait is the server's
``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date) when it gives one, else exponential backoff
from 0.5 s doubling to at most 8 s, shortened by up to a quarter at random so that requests refused together
do not come back together. A server asking for more than ``max_retry_after_s`` is not retried. A 429 pauses
the whole teacher for its wait, not only the request that got it. 401, 403 and 404 mean the key or the model
is wrong: the teacher is asked nothing more.

The key is read from the environment variable the config names when each request is sent, without the
whitespace around it (``read_key``), goes only into the Authorization header, and is scrubbed from any error
text before it is logged. A key holding a character no HTTP header may carry is never sent: the teacher is
disabled, naming the variable, not the value (``harvest`` and ``launch`` refuse it before anything starts).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import httpx

from composer_serverless.config import HarvestConfig, TeacherConfig
from composer_serverless.executors import retrying
from composer_serverless.harvest.costs import Budget, Price

logger = logging.getLogger(__name__)

INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
RETRIED_STATUSES = frozenset({408, 409, 429})
FATAL_STATUSES = {401: "unauthorized", 403: "forbidden", 404: "not found (the base URL or the model)"}
# Transport failures before a byte of the request left, so the server cannot have billed them: no connection,
# or a request h11 refused to write (LocalProtocolError; for these requests, whose body is known in full before
# they go, an illegal header, found before anything is written).
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.LocalProtocolError)


# What a key may hold to be sent in a header: visible ASCII (RFC 9110's field-vchar without obs-text; a Bearer
# token, RFC 6750, is narrower still). No space, no control character, nothing httpx could not encode.
HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


class UnusableKey(ValueError):
    """A key no HTTP header can carry; the message names its variable, never the value."""


def read_key(name: str) -> str | None:
    """The key in the environment variable ``name`` without the whitespace around it (a ``.env`` file saved
    with CRLF line ends leaves a CR after it); None when it is unset or blank.

    Raises:
        UnusableKey: what is left holds a space, a control character or a non-ASCII character.
    """
    key = os.environ.get(name, "").strip()
    if not key:
        return None
    if not HEADER_SAFE.fullmatch(key):
        raise UnusableKey(
            f"the key in {name} holds a character an HTTP header cannot carry (a space, a control character "
            "or a non-ASCII one)"
        )
    return key


class MalformedAnswer(ValueError):
    """A 2xx response that is not a chat completion with a message."""


@dataclass(frozen=True)
class Completion:
    """What a chat completion says: the first choice's text (None for a refusal or a tool call), the tokens
    its usage reports (None when it reports none) and why it stopped."""

    content: str | None
    usage: tuple[int, int] | None
    finish_reason: str | None
    model: str | None


def parse_completion(data: bytes) -> Completion:
    """Read an OpenAI chat completion (``choices[0].message.content``, ``usage.prompt_tokens`` and
    ``completion_tokens``).

    Raises:
        MalformedAnswer: not JSON, or no ``choices[0].message``.
    """
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedAnswer(f"the response is not JSON ({e})") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedAnswer("the response has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise MalformedAnswer("the first choice has no message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise MalformedAnswer(f"the message's content is a {type(content).__name__}, not text")
    return Completion(
        content, usage_of(obj), choices[0].get("finish_reason"), obj.get("model") if "model" in obj else None
    )


def usage_of(obj: Any) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of a response, when it reports both as counts."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        return tokens[0], tokens[1]
    return None


def retry_after_s(headers: httpx.Headers, now: float) -> float | None:
    """The wait a response asks for: ``retry-after-ms``, else ``Retry-After`` in seconds or as an HTTP date
    (``now`` is ``time.time()``); None when it asks for none or says it unreadably."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            seconds = float(millis) / 1000.0
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    return retrying.retry_after_s(headers.get("retry-after"), now)


def backoff_s(retry: int, rng: random.Random) -> float:
    """Exponential backoff before retry number ``retry`` (0 first): 0.5 s doubling to at most 8 s, less up to
    a quarter at random."""
    return min(INITIAL_RETRY_DELAY_S * 2.0**retry, MAX_RETRY_DELAY_S) * (1 - 0.25 * rng.random())


def should_retry(status: int, headers: httpx.Headers) -> bool:
    """The ``openai`` client's rule: ``x-should-retry`` if the server sets it, else 408, 409, 429 and 5xx."""
    told = headers.get("x-should-retry")
    if told in ("true", "false"):
        return told == "true"
    return status in RETRIED_STATUSES or status >= 500


def error_text(response: httpx.Response, secret: str | None) -> str:
    """A one-line reason from an error response (the OpenAI ``{"error": {"message"}}`` body, else its start),
    with the key removed wherever the server echoed it."""
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        message = response.text
    message = " ".join(str(message).split())[:200]
    return scrub(f"HTTP {response.status_code}: {message}", secret)


def scrub(text: str, secret: str | None) -> str:
    """``text`` without ``secret``, as it is and as Python or JSON escape it (an error that shows the bytes
    it refused, ``b'Bearer sk-...\\r'``, holds the key escaped)."""
    if not secret:
        return text
    forms = {secret, repr(secret)[1:-1], repr(secret.encode())[2:-1], json.dumps(secret)[1:-1]}
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, "***")
    return text


@dataclass
class Attempt:
    """One HTTP request: its latency, status (None: no response), tokens charged and USD charged."""

    latency_s: float
    status: int | None
    ok: bool
    tokens_in: int = 0
    tokens_out: int = 0
    usd: Fraction = Fraction(0)
    error: str | None = None


@dataclass
class Reply:
    """A teacher's answer to one prompt, after every attempt.

    Attributes:
        outcome: "answered", "failed" (retries spent or not retryable), "refused" (the cap did not allow a
            request) or "disabled" (the teacher was disabled: key or model wrong).
        completion: the answer, when answered.
        attempts: every request sent for it.
    """

    outcome: str
    completion: Completion | None = None
    attempts: list[Attempt] = field(default_factory=list)
    error: str | None = None

    @property
    def usd(self) -> Fraction:
        return sum((a.usd for a in self.attempts), Fraction(0))

    @property
    def latency_s(self) -> float | None:
        return self.attempts[-1].latency_s if self.outcome == "answered" else None


class TeacherClient:
    """Asks one teacher, ``concurrency`` requests at a time, through a shared ``httpx.AsyncClient``."""

    def __init__(
        self, teacher: TeacherConfig, http: httpx.AsyncClient, config: HarvestConfig, rng: random.Random
    ) -> None:
        self.teacher = teacher
        self._http = http
        self._url = f"{teacher.base_url}/chat/completions"
        self._price = Price.of(teacher)
        self._retries = config.retries
        self._max_retry_after_s = config.max_retry_after_s
        self._timeout_s = config.timeout_s
        self._rng = rng
        self._slots = asyncio.Semaphore(teacher.concurrency)
        self._not_before = 0.0  # time.monotonic() before which no request goes out (after a 429)
        self.disabled: str | None = None

    def _key(self) -> str | None:
        name = self.teacher.api_key_env
        if name is None:
            return None
        try:
            key = read_key(name)
        except UnusableKey as e:
            self.disabled = str(e)
            return None
        if key is None:
            self.disabled = f"the environment variable {name} is not set"
        return key

    async def ask(self, body: bytes, worst: Fraction, budget: Budget) -> Reply:
        """Send ``body`` until it is answered, fails for good, or the cap refuses it."""
        reply = Reply("failed")
        idempotency = f"composer-serverless-{uuid.uuid4()}"
        async with self._slots:
            for retry in range(self._retries + 1):
                pause = self._not_before - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                if self.disabled:
                    reply.outcome, reply.error = "disabled", self.disabled
                    return reply
                if not await budget.reserve(worst):
                    reply.outcome = "refused"
                    reply.error = budget.broken or "the spending cap"
                    return reply
                wait = await self._attempt(body, worst, budget, idempotency, reply)
                if wait is None:
                    if reply.outcome != "answered":
                        logger.warning("teacher %s: %s (not retried)", self.teacher.name, reply.error)
                    return reply
                if retry < self._retries:
                    logger.info(
                        "teacher %s: %s; retry %d of %d in %.2f s",
                        self.teacher.name,
                        reply.error,
                        retry + 1,
                        self._retries,
                        wait,
                    )
                    await asyncio.sleep(wait)
        logger.warning(
            "teacher %s: gave up after %d attempts: %s", self.teacher.name, len(reply.attempts), reply.error
        )
        return reply

    async def _attempt(
        self, body: bytes, worst: Fraction, budget: Budget, idempotency: str, reply: Reply
    ) -> float | None:
        """One request, settled with the budget and recorded in ``reply``; the wait before retrying, or None
        when there is nothing to retry (answered, or failed for good)."""
        retry_index = len(reply.attempts)
        key = self._key()
        if self.disabled:
            await budget.settle(worst, Fraction(0))
            reply.outcome, reply.error = "disabled", self.disabled
            return None
        headers = {"content-type": "application/json", "idempotency-key": idempotency}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        started = time.monotonic()
        try:
            response = await asyncio.wait_for(
                self._http.post(self._url, content=body, headers=headers), timeout=self._timeout_s
            )
        except (httpx.RequestError, asyncio.TimeoutError) as e:
            sent = not isinstance(e, NOT_SENT)
            # Possibly processed and billed (a timeout or a connection cut after sending): its worst case.
            charged = worst if sent else Fraction(0)
            reason = f"{type(e).__name__}: {scrub(str(e), key) or 'no response'}"
            return await self._failed(reply, worst, charged, budget, started, None, reason, retry_index)
        except BaseException:
            # Anything else (the harvest cancelled, its client closed): the request may have left, so it is
            # counted at its worst case, and the error goes on.
            await budget.settle(worst, worst)
            raise
        latency = time.monotonic() - started
        if not response.is_success:
            reason = error_text(response, key)
            if response.status_code in FATAL_STATUSES:
                self.disabled = f"HTTP {response.status_code} {FATAL_STATUSES[response.status_code]}" + (
                    f": check the key in {self.teacher.api_key_env}"
                    if response.status_code in (401, 403)
                    else ""
                )
                reason = self.disabled
            await budget.settle(worst, Fraction(0))  # an error status is not billed
            reply.attempts.append(Attempt(latency, response.status_code, False, error=reason))
            reply.error = reason
            if self.disabled:
                reply.outcome = "disabled"
                return None
            wait = retry_after_s(response.headers, time.time())
            if not should_retry(response.status_code, response.headers):
                return None
            if wait is not None and wait > self._max_retry_after_s:
                reply.error = f"{reason} (asks to wait {wait:.0f} s, more than max_retry_after_s)"
                return None
            if wait is None or wait <= 0:
                wait = backoff_s(retry_index, self._rng)
            if response.status_code == 429:
                self._not_before = max(self._not_before, time.monotonic() + wait)
            return wait
        try:
            completion = parse_completion(response.content)
        except MalformedAnswer as e:
            usage = usage_of(_json_or_none(response.content))
            charged, overrun = self._charge(usage, worst)
            return await self._failed(
                reply,
                worst,
                charged,
                budget,
                started,
                response.status_code,
                str(e),
                retry_index,
                usage,
                overrun,
            )
        usage = completion.usage
        charged, overrun = self._charge(usage, worst)
        await budget.settle(worst, charged, overrun)
        tokens = usage or (0, 0)
        reply.attempts.append(Attempt(latency, response.status_code, True, tokens[0], tokens[1], charged))
        reply.outcome, reply.completion, reply.error = "answered", completion, None
        return None

    def _charge(self, usage: tuple[int, int] | None, worst: Fraction) -> tuple[Fraction, str | None]:
        """What a response is charged: what its usage reports, else its worst case; and, when the usage is more
        than the bound, why no further request is sent (``Budget.broken``)."""
        if usage is None:
            return worst, None
        charged = self._price.cost(*usage)
        if charged <= worst:
            return charged, None
        overrun = (
            f"teacher {self.teacher.name} reported {usage} tokens (in, out), more than the bound of this "
            f"request: raise its extra_input_tokens (or check max_tokens); no further request is sent"
        )
        logger.error(overrun)
        return charged, overrun

    async def _failed(
        self,
        reply: Reply,
        worst: Fraction,
        charged: Fraction,
        budget: Budget,
        started: float,
        status: int | None,
        reason: str,
        retry_index: int,
        usage: tuple[int, int] | None = None,
        overrun: str | None = None,
    ) -> float:
        await budget.settle(worst, charged, overrun)
        tokens = usage or (0, 0)
        reply.attempts.append(
            Attempt(time.monotonic() - started, status, False, tokens[0], tokens[1], charged, reason)
        )
        reply.error = reason
        return backoff_s(retry_index, self._rng)


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None

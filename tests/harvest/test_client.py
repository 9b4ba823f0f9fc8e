"""The retry rules (as the ``openai`` client has them), reading a chat completion, and the fake teacher held
to the real ``openai`` client, so the other tests' fake behaves like a server that client talks to."""

from __future__ import annotations

import asyncio
import json
import random
import time
from fractions import Fraction
from types import SimpleNamespace

import httpx
import pytest

from composer_serverless.harvest.client import (
    MalformedAnswer,
    TeacherClient,
    backoff_s,
    error_text,
    parse_completion,
    retry_after_s,
    scrub,
    should_retry,
)
from composer_serverless.harvest.costs import Budget
from tests.harvest.conftest import harvest_config
from tests.harvest.fake_teacher import Behaviour, http_date

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # milliseconds win, as in openai
        ({"retry-after": "Wed, 15 Jan 2027 08:00:10 GMT"}, 1_800_000_010.0 - NOW),
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_after(headers, expected):
    assert retry_after_s(httpx.Headers(headers), NOW) == expected


def test_backoff_doubles_from_half_a_second_to_eight_less_up_to_a_quarter():
    rng = random.Random(0)
    for retry, base in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        waits = [backoff_s(retry, rng) for _ in range(200)]
        assert all(0.75 * base <= w <= base for w in waits)
        assert max(waits) - min(waits) > 0.2 * base  # jittered, not constant


@pytest.mark.parametrize(
    ("status", "headers", "retried"),
    [
        (408, {}, True),
        (409, {}, True),
        (429, {}, True),
        (500, {}, True),
        (503, {}, True),
        (400, {}, False),
        (401, {}, False),
        (404, {}, False),
        (400, {"x-should-retry": "true"}, True),
        (503, {"x-should-retry": "false"}, False),
    ],
)
def test_which_statuses_are_retried(status, headers, retried):
    assert should_retry(status, httpx.Headers(headers)) is retried


def test_a_chat_completion_and_what_is_not_one():
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        "model": "m",
    }
    parsed = parse_completion(json.dumps(body).encode())
    assert (parsed.content, parsed.usage, parsed.finish_reason, parsed.model) == ("7", (12, 1), "stop", "m")
    body["usage"] = {"total_tokens": 13}
    assert parse_completion(json.dumps(body).encode()).usage is None
    body["choices"][0]["message"]["content"] = None  # a refusal: an answer without text
    assert parse_completion(json.dumps(body).encode()).content is None
    for bad in (b'{"choices": [', b'{"choices": []}', b'{"choices": [{"text": "7"}]}', b"[]", b"\xff"):
        with pytest.raises(MalformedAnswer):
            parse_completion(bad)


def test_error_text_is_the_openai_message_without_the_key():
    response = httpx.Response(
        401,
        json={"error": {"message": "Incorrect API key provided: sk-secret-123.", "type": "x", "code": None}},
    )
    assert error_text(response, "sk-secret-123") == "HTTP 401: Incorrect API key provided: ***."


def test_scrub_removes_the_key_escaped_too():
    """httpx shows the header value it refused as bytes (b'Bearer sk-x\\r'), the key escaped in it."""
    key = "sk-secret-123\r\n"
    message = f"Illegal header value {f'Bearer {key}'.encode()!r}; as text {key!r}; as JSON {json.dumps(key)}"
    assert "sk-secret-123" not in scrub(message, key)
    assert scrub("HTTP 401: sk-secret-123 is wrong", "sk-secret-123") == "HTTP 401: *** is wrong"


def test_the_fake_is_a_server_the_real_openai_client_accepts(teachers):
    """The official client parses the fake's completions into its own types, retries its 429 after the
    Retry-After it sends, and raises AuthenticationError for its 401."""
    openai = pytest.importorskip("openai")
    script = {"busy": [Behaviour(status=429, retry_after="1"), Behaviour(answer="42")]}
    (fake,) = teachers(
        1,
        key="sk-test-key-123456",
        script=lambda prompt, attempt: script.get(prompt, [Behaviour("x")])[min(attempt, 1)],
    )
    client = openai.OpenAI(base_url=fake.base_url, api_key="sk-test-key-123456", max_retries=2)
    started = time.monotonic()
    completion = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "busy"}], max_tokens=5
    )
    assert time.monotonic() - started >= 1.0
    assert completion.choices[0].message.content == "42" and completion.usage.completion_tokens == 2
    assert [s.status for s in fake.seen] == [429, 200]
    wrong = openai.OpenAI(base_url=fake.base_url, api_key="sk-wrong-key-000000", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided: sk-\\*\\*\\*\\*0000"):
        wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


def test_http_date_is_what_retry_after_reads_back():
    assert abs(retry_after_s(httpx.Headers({"retry-after": http_date(30)}), time.time()) - 30) <= 1


def _ask_through(transport: httpx.AsyncBaseTransport, retries: int = 1):
    """One prompt asked of a teacher whose requests go through ``transport``: the reply and the budget."""
    teacher = SimpleNamespace(base_url="http://127.0.0.1:9/v1", usd_per_m_input=1.0, usd_per_m_output=1.0)
    config = harvest_config([teacher], key_env=None, threshold=1, retries=retries)

    async def ask():
        budget = Budget(Fraction(1))
        async with httpx.AsyncClient(transport=transport) as http:
            client = TeacherClient(config.teachers[0], http, config, random.Random(0))
            return await client.ask(b"{}", Fraction(1, 1000), budget), budget

    return asyncio.run(ask())


def test_a_request_httpx_refused_to_write_is_not_charged(quick_backoff):
    """h11 refuses an illegal header before a byte is written (LocalProtocolError): the server cannot have
    billed it, so it costs nothing, however often it is retried."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.LocalProtocolError("Illegal header value b'x\\r'")

    reply, budget = _ask_through(httpx.MockTransport(refuse))
    assert reply.outcome == "failed" and len(reply.attempts) == 2
    assert budget.spent == 0 and budget.in_flight == 0

"""A fake OpenAI-compatible chat server on loopback, scripted per prompt, that bills what it serves.

It follows the wire contract the ``openai`` client (``openai/_base_client.py``, ``types/chat/chat_completion.py``)
and the OpenAI API reference describe: ``POST /v1/chat/completions`` with a Bearer key; a ``chat.completion``
object with ``choices[0].message.content``, ``finish_reason`` ("length" when ``max_tokens`` or
``max_completion_tokens`` cut the answer) and ``usage``; errors as ``{"error": {"message", "type", "param",
"code"}}`` with 401 for a wrong key (its message masks the key as OpenAI's does, keeping its first and last
characters), 429 with ``Retry-After`` (seconds or an HTTP date) or ``retry-after-ms``, 5xx for server errors;
HTTP/1.1 keep-alive.

Each prompt's script says, per attempt, what happens: an answer, an error status, a delay, a body that is not
JSON, an answer without usage, a dropped connection. The server counts tokens as a tokenizer would at worst for the bound (a token
per byte of every message's text, 4 per message, 3 to prime the reply) and an answer's tokens as its
characters, and bills every 200 it sends at its prices: ``billed`` is what a provider would charge.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Behaviour:
    """What one attempt at one prompt gets.

    Attributes:
        answer: the assistant's text (None: a message without content, as for a refusal).
        status: the HTTP status; an error body is sent unless it is 200.
        retry_after: a ``Retry-After`` header value (seconds, or an HTTP date); ``retry_after_ms`` likewise.
        delay_s: how long the server takes before answering.
        malformed: send a body that is not JSON (billed all the same: the answer was generated).
        usage: report usage.
        no_choices: a JSON body without choices.
        together: hold the answer until this many requests are in the server at once (at most
            ``TOGETHER_WAIT_S``): how many a client keeps in flight is then seen whatever the machine's speed.
        hold: hold the answer until this event is set (at most ``HOLD_WAIT_S``): a request slower than any
            timeout, whatever the machine's speed.
        drop: bill the answer, then close the connection without sending it (a server that died mid-request).
    """

    answer: str | None = "ok"
    status: int = 200
    retry_after: str | None = None
    retry_after_ms: str | None = None
    delay_s: float = 0.0
    malformed: bool = False
    usage: bool = True
    no_choices: bool = False
    together: int = 0
    hold: threading.Event | None = None
    drop: bool = False


TOGETHER_WAIT_S = 5.0
HOLD_WAIT_S = 60.0
Script = Callable[[str, int], Behaviour]  # (the user message, attempt number from 0) -> behaviour


def answers(table: dict[str, str], default: str = "none") -> Script:
    """A script that answers each prompt (the user message) from ``table``, at once."""
    return lambda prompt, attempt: Behaviour(answer=table.get(prompt, default))


def http_date(seconds_from_now: float) -> str:
    return email.utils.formatdate(time.time() + seconds_from_now, usegmt=True)


@dataclass
class Seen:
    """A request as the server received it (the Authorization header only as whether it was right)."""

    prompt: str
    body: dict[str, Any]
    authorized: bool
    idempotency_key: str | None
    status: int
    time: float


class _Server(ThreadingHTTPServer):
    """A thread per connection, and a listen backlog as deep as uvicorn's (2048): http.server's default of 5
    drops the SYNs of a client opening many connections at once, which then wait a second to retry."""

    daemon_threads = True
    request_queue_size = 2048


@dataclass
class FakeTeacher:
    key: str | None
    usd_per_m_input: float = 0.0
    usd_per_m_output: float = 0.0
    script: Script = field(default=lambda prompt, attempt: Behaviour())
    seen: list[Seen] = field(default_factory=list)
    billed: Fraction = Fraction(0)
    attempts: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight_changed = threading.Condition(self._lock)
        self._server = _Server(("127.0.0.1", 0), self._handler())
        # A short poll: stopping waits for it, and the tests stop three fakes each.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def tokens_in(self, messages: list[dict[str, Any]]) -> int:
        return sum(len(str(m.get("content", "")).encode()) + 4 for m in messages) + 3

    def _bill(self, tokens_in: int, tokens_out: int) -> None:
        price = Fraction(self.usd_per_m_input) * tokens_in + Fraction(self.usd_per_m_output) * tokens_out
        self.billed += price / 1_000_000

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # as uvicorn does: headers and body leave at once, no delayed ACK

            def log_message(self, format: str, *args: object) -> None:
                pass

            pending: tuple[str, dict[str, Any], bool] | None = None

            def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
                if self.pending is not None:  # recorded before it is sent: a client that has it sees it
                    prompt, body, authorized = self.pending
                    seen = Seen(
                        prompt, body, authorized, self.headers.get("idempotency-key"), status, time.time()
                    )
                    with fake._lock:
                        fake.seen.append(seen)
                try:
                    self._respond(status, payload, headers)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (a timeout)
                    self.close_connection = True

            def _respond(self, status: int, payload: bytes, headers: dict[str, str] | None) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def _error(self, status: int, message: str, kind: str, code: str | None, **headers: str) -> None:
                body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
                self._send(status, json.dumps(body).encode(), headers)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self.pending = None
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/chat/completions":
                    self._error(404, f"Invalid URL (POST {self.path})", "invalid_request_error", None)
                    return
                try:
                    body = json.loads(raw)
                    messages = body["messages"]
                    prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
                except (ValueError, KeyError, StopIteration, TypeError):
                    self._error(
                        400,
                        "We could not parse the JSON body of your request.",
                        "invalid_request_error",
                        None,
                    )
                    return
                given = self.headers.get("authorization", "")
                authorized = fake.key is None or given == f"Bearer {fake.key}"
                self.pending = (prompt, body, authorized)
                with fake._lock:
                    attempt = fake.attempts[prompt]
                    fake.attempts[prompt] += 1
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    fake._in_flight_changed.notify_all()
                try:
                    self._serve(body, messages, prompt, attempt, authorized, given)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

            def _serve(
                self,
                body: dict[str, Any],
                messages: list[Any],
                prompt: str,
                attempt: int,
                authorized: bool,
                given: str,
            ) -> int:
                if not authorized:
                    shown = given.removeprefix("Bearer ")
                    masked = f"{shown[:3]}****{shown[-4:]}" if len(shown) > 8 else "****"
                    self._error(
                        401,
                        f"Incorrect API key provided: {masked}. You can find your API key at "
                        "https://platform.openai.com/account/api-keys.",
                        "invalid_request_error",
                        "invalid_api_key",
                    )
                    return 401
                act = fake.script(prompt, attempt)
                if act.together:
                    with fake._in_flight_changed:
                        fake._in_flight_changed.wait_for(
                            lambda: fake.in_flight >= act.together, timeout=TOGETHER_WAIT_S
                        )
                if act.hold is not None:
                    act.hold.wait(HOLD_WAIT_S)
                if act.delay_s:
                    time.sleep(act.delay_s)
                if act.status != 200:
                    headers = {}
                    if act.retry_after is not None:
                        headers["retry-after"] = act.retry_after
                    if act.retry_after_ms is not None:
                        headers["retry-after-ms"] = act.retry_after_ms
                    kind, code, message = {
                        429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests"),
                        500: ("server_error", None, "The server had an error while processing your request."),
                        503: (
                            "server_error",
                            None,
                            "The engine is currently overloaded, please try again later.",
                        ),
                    }.get(act.status, ("invalid_request_error", None, "error"))
                    self._error(act.status, message, kind, code, **headers)
                    return act.status
                limit = body.get("max_completion_tokens", body.get("max_tokens"))
                content = act.answer
                finish = "stop"
                if content is not None and limit is not None and len(content) > limit:
                    content, finish = content[:limit], "length"
                tokens_in = fake.tokens_in(messages)
                tokens_out = 0 if content is None else len(content)
                with fake._lock:
                    fake._bill(tokens_in, tokens_out)
                if act.drop:
                    self.close_connection = True
                    return 200
                if act.malformed:
                    self._send(200, b'{"id": "chatcmpl-x", "choices": [{"message": ')  # cut off mid-object
                    return 200
                completion: dict[str, Any] = {
                    "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content, "refusal": None},
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                    ],
                    "system_fingerprint": "fp_fake",
                }
                if act.no_choices:
                    completion["choices"] = []
                if act.usage:
                    completion["usage"] = {
                        "prompt_tokens": tokens_in,
                        "completion_tokens": tokens_out,
                        "total_tokens": tokens_in + tokens_out,
                        "prompt_tokens_details": {"cached_tokens": 0},
                        "completion_tokens_details": {"reasoning_tokens": 0},
                    }
                self._send(200, json.dumps(completion).encode())
                return 200

        return Handler


def main() -> None:
    """``python -m tests.harvest.fake_teacher TEACHERS LATENCY_S``: serve that many teachers answering "42"
    after LATENCY_S, with the key in ``$FAKE_TEACHER_KEY``, in a process of their own; print their base URLs
    (one JSON line), then for every line read print each one's most requests in flight at once, until EOF."""
    import os
    import sys

    count, latency = int(sys.argv[1]), float(sys.argv[2])
    fakes = [
        FakeTeacher(
            key=os.environ["FAKE_TEACHER_KEY"], script=lambda p, a: Behaviour(answer="42", delay_s=latency)
        )
        for _ in range(count)
    ]
    print(json.dumps([f.base_url for f in fakes]), flush=True)
    for _ in sys.stdin:
        print(json.dumps([f.max_in_flight for f in fakes]), flush=True)
    for fake in fakes:
        fake.stop()


if __name__ == "__main__":
    main()

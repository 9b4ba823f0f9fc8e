"""A teacher whose key is wrong, one that asks for too long a wait, one that reports more tokens than the
bound, and one flooded with prompts; and an entry in the cache that is not one."""

from __future__ import annotations

import asyncio
import threading
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from composer_serverless.harvest.cache import AnswerCache, cache_key
from composer_serverless.harvest.costs import Budget
from composer_serverless.harvest.harvester import harvest, request_body
from composer_serverless.harvest.states import State
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.harvest.conftest import CANARY, harvest_config
from tests.harvest.fake_teacher import Behaviour, answers

STATES = [State(str(i), f"q{i}", "wrong") for i in range(12)]


def _run(config, cache_dir, states=STATES, max_usd=10.0):
    budget = Budget(Fraction(max_usd))
    return asyncio.run(harvest(states, config, AnswerCache(ObjectStore(str(cache_dir))), budget)), budget


def test_a_wrong_key_disables_its_teacher_and_its_echo_is_never_logged(
    teachers, tmp_path, monkeypatch, caplog
):
    caplog.set_level("INFO")
    monkeypatch.setenv("TEACHER_KEY", CANARY)
    good = teachers(2, key=CANARY, script=answers({}, default="right"))
    (locked,) = teachers(1, key="sk-the-servers-own-key-99", script=answers({}, default="right"))
    config = harvest_config([*good, locked], threshold=2)
    result, _ = _run(config, tmp_path / "cache")
    stats = {t.name: t for t in result.teachers}
    # Requests already in flight when the first 401 came back are all it got: at most its concurrency.
    assert 1 <= stats["t2"].requests <= config.teachers[2].concurrency and stats["t2"].answered == 0
    assert "401 unauthorized: check the key in TEACHER_KEY" in stats["t2"].disabled
    assert result.problems == [f"teacher t2: {stats['t2'].disabled}"]
    assert len(result.pairs) == 12  # the two others still agree
    assert CANARY not in caplog.text and CANARY[-4:] not in caplog.text  # not even OpenAI's masked echo


def test_a_key_read_with_its_line_end_is_sent_without_it(teachers, tmp_path, monkeypatch, caplog):
    """A .env file saved with CRLF line ends leaves a CR (or CRLF) after the key: it is sent without it, and
    neither it nor an escaped form of it reaches a log line."""
    caplog.set_level("INFO")
    monkeypatch.setenv("TEACHER_KEY", CANARY + "\r\n")
    (fake,) = teachers(1, key=CANARY, script=answers({}, default="a"))
    result, _ = _run(harvest_config([fake], threshold=1), tmp_path / "cache", states=STATES[:2])
    assert result.teachers[0].answered == 2 and all(s.authorized for s in fake.seen)
    assert CANARY not in caplog.text


def test_a_key_an_http_header_cannot_carry_is_never_sent(teachers, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO")
    broken = CANARY[:12] + "\x01" + CANARY[12:]  # a control character inside: no header may carry it
    monkeypatch.setenv("TEACHER_KEY", broken)
    (fake,) = teachers(1, key=CANARY, script=answers({}, default="a"))
    result, _ = _run(harvest_config([fake], threshold=1), tmp_path / "cache", states=STATES[:2])
    assert not fake.seen and result.teachers[0].answered == 0
    assert "the key in TEACHER_KEY holds a character an HTTP header cannot carry" in result.problems[0]
    assert CANARY[:12] not in caplog.text and CANARY[12:] not in caplog.text


class _Proxy(BaseHTTPRequestHandler):
    """A forward proxy that records what it is asked to forward (the request line and the Authorization it
    would read in clear) and forwards nothing."""

    seen: list[tuple[str, str | None]] = []

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.seen.append((self.requestline, self.headers.get("authorization")))
        self.send_response(502)
        self.send_header("content-length", "0")
        self.end_headers()


def test_a_plain_http_teacher_is_asked_directly_whatever_proxy_the_environment_names(
    teachers, tmp_path, monkeypatch
):
    """A proxy would read the key of a plain-http request in clear: such a teacher (on this machine, when a
    key is sent) is never asked through one."""
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
    try:
        address = f"http://127.0.0.1:{proxy.server_address[1]}"
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            monkeypatch.setenv(name, address)
            monkeypatch.setenv(name.lower(), address)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv("TEACHER_KEY", CANARY)
        (fake,) = teachers(1, key=CANARY, script=answers({}, default="a"))
        result, _ = _run(
            harvest_config([fake], threshold=1, retries=0), tmp_path / "cache", states=STATES[:2]
        )
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert _Proxy.seen == []
    assert result.teachers[0].answered == 2 and all(s.authorized for s in fake.seen)


class _UnwritableCache(AnswerCache):
    """A cache whose store refuses every write."""

    async def aput(self, *args: object) -> None:
        raise OSError("the store refused the write")


def test_a_store_error_stops_the_harvest_with_nothing_left_running_or_uncounted(
    teachers, tmp_path, monkeypatch
):
    """The first answer cannot be cached: the harvest fails with that error, and by then every other query is
    stopped (none goes on sending) and each request it had reserved for is settled, at its worst case if it may
    have been sent."""
    monkeypatch.setenv("TEACHER_KEY", "k")
    (fake,) = teachers(1, key="k", usd_per_m_input=1.0, usd_per_m_output=1.0, script=answers({}, default="a"))
    config = harvest_config([fake], threshold=1, teacher={"concurrency": 4})

    async def scenario():
        budget = Budget(Fraction(10))
        with pytest.raises(OSError, match="the store refused the write"):
            await harvest(STATES, config, _UnwritableCache(ObjectStore(str(tmp_path / "cache"))), budget)
        return budget, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    budget, running = asyncio.run(scenario())
    assert running == []
    assert budget.in_flight == 0 and fake.billed <= budget.spent


def test_a_longer_wait_than_allowed_is_not_retried(teachers, tmp_path, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", "k")
    (fake,) = teachers(1, key="k", script=lambda prompt, attempt: Behaviour(status=429, retry_after="600"))
    config = harvest_config([fake], threshold=1, max_retry_after_s=30)
    result, _ = _run(config, tmp_path / "cache", states=STATES[:2])
    assert len(fake.seen) == 2 and result.teachers[0].unanswered == 2 and not result.pairs


@pytest.mark.parametrize("chat_completion", [True, False], ids=["answer", "not-a-chat-completion"])
def test_a_teacher_reporting_more_than_the_bound_stops_the_harvest(
    teachers, tmp_path, monkeypatch, quick_backoff, chat_completion
):
    """Whether or not the response is a chat completion, the usage it reports is what it is charged, and
    usage beyond the bound stops every further request (the retry of a response without choices too)."""
    monkeypatch.setenv("TEACHER_KEY", "k")
    (fake,) = teachers(
        1,
        key="k",
        usd_per_m_input=1.0,
        script=lambda prompt, attempt: Behaviour(answer="a", no_choices=not chat_completion),
    )
    fake.tokens_in = lambda messages: 10_000  # a server whose prompts cost more than their bytes
    config = harvest_config([fake], threshold=1, teacher={"concurrency": 1})
    result, budget = _run(config, tmp_path / "cache")
    assert len(fake.seen) == 1 and budget.refused == 11 + (not chat_completion)
    assert "reported (10000, 1) tokens" in result.stopped and "extra_input_tokens" in result.stopped
    assert result.spent == Fraction(10_000 + 0, 10**6)  # charged what it reported (output is free here)


def test_each_teacher_keeps_its_concurrency(teachers, tmp_path, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", "k")
    # The first prompts' answers wait until three requests are in: a client keeping three in flight is seen
    # to, however slowly it sends them (and one keeping more would be seen too).
    first = {"q0", "q1", "q2"}
    fakes = teachers(
        2, key="k", script=lambda prompt, attempt: Behaviour(answer="a", together=3 * (prompt in first))
    )
    config = harvest_config(fakes, teacher={"concurrency": 3})
    _run(config, tmp_path / "cache")
    assert [f.max_in_flight for f in fakes] == [3, 3]


def test_an_unreadable_cache_entry_is_a_miss(teachers, tmp_path, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", "k")
    (fake,) = teachers(1, key="k", script=answers({}, default="a"))
    config = harvest_config([fake], threshold=1)
    cache = ObjectStore(str(tmp_path / "cache"))
    digest = cache_key(config.teachers[0], request_body(config, config.teachers[0], "q0"))
    cache.put(layout.cache_entry(digest), b'{"content": 5}')
    result, _ = _run(config, tmp_path / "cache", states=STATES[:1])
    assert result.teachers[0].answered == 1 and len(fake.seen) == 1
    assert b'"content": "a"' in cache.get(layout.cache_entry(digest))

"""Harvests against fake teachers on loopback: the pairs are the scripted majority through 429s, 5xx, slow,
cut-off and malformed answers and dropped connections; the spend is what the servers bill, never less; a
request slower than the timeout is given up on; a second run is answered by the cache for $0."""

from __future__ import annotations

import asyncio
import json
import threading
from fractions import Fraction

import pytest

from composer_serverless.harvest.cache import AnswerCache, cache_key
from composer_serverless.harvest.costs import Budget, Price, worst_case
from composer_serverless.harvest.harvester import harvest, request_body
from composer_serverless.harvest.states import State
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.harvest.conftest import CANARY, harvest_config
from tests.harvest.fake_teacher import Behaviour, http_date

# What each teacher answers; p9 the third never answers (it drops the connection every time).
ANSWERS = {
    "p0": ("A", "A", "A"),
    "p1": ("B", "B", "C"),
    "p2": ("C", "D", "C"),
    "p3": ("1", "2", "3"),  # no majority: no pair
    "p4": ("E", "E", "F"),
    "p5": ("G", "G", "G"),
    "p6": ("H", "I", "I"),
    "p7": ("J", "J", "J"),
    "p8": ("K", "K", "L"),
    "p9": ("M", "M", "N"),
}
# The student's answers; several states share a prompt, some agree with the teachers.
STUDENT = [
    ("s0", "p0", "x"),
    ("s1", "p0", "A"),
    ("s2", "p1", "C"),
    ("s3", "p1", "C"),
    ("s4", "p2", "D"),
    ("s5", "p3", "1"),
    ("s6", "p4", "E"),
    ("s7", "p5", "g"),
    ("s8", "p6", "H"),
    ("s9", "p7", "q"),
    ("s10", "p8", "K"),
    ("s11", "p9", "N"),
]
EXPECTED_PAIRS = [  # (prompt, chosen, rejected, states)
    ("p0", "A", "x", ["s0"]),
    ("p1", "B", "C", ["s2", "s3"]),
    ("p2", "C", "D", ["s4"]),
    ("p5", "G", "g", ["s7"]),
    ("p6", "I", "H", ["s8"]),
    ("p7", "J", "q", ["s9"]),
    ("p9", "M", "N", ["s11"]),
]
# Per teacher and prompt, what each attempt gets before the answer.
TROUBLE = {
    (0, "p1"): [Behaviour(status=429, retry_after="1")],
    (0, "p4"): [Behaviour(no_choices=True)],
    (0, "p7"): [Behaviour(status=429, retry_after="date")],
    (1, "p2"): [Behaviour(status=500), Behaviour(status=503)],
    (1, "p5"): [],  # answers without usage
    (1, "p8"): [Behaviour(status=429, retry_after_ms="50")],
    (2, "p3"): [Behaviour(malformed=True)],
    (2, "p6"): [],  # answers slowly
}


def _script(index: int):
    def script(prompt: str, attempt: int) -> Behaviour:
        if index == 2 and prompt == "p9":
            return Behaviour(answer="N", drop=True)
        before = TROUBLE.get((index, prompt), [])
        if attempt < len(before):
            act = before[attempt]
            return (
                Behaviour(status=act.status, retry_after=http_date(1), no_choices=act.no_choices)
                if (act.retry_after == "date")
                else act
            )
        answer = ANSWERS[prompt][index]
        if (index, prompt) == (1, "p5"):
            return Behaviour(answer=answer, usage=False)
        if (index, prompt) == (2, "p6"):
            return Behaviour(answer=answer, delay_s=0.1)
        return Behaviour(answer=answer)

    return script


@pytest.fixture
def scripted(teachers, monkeypatch, quick_backoff):
    monkeypatch.setenv("TEACHER_KEY", CANARY)
    fakes = teachers(3, key=CANARY, usd_per_m_input=3.0, usd_per_m_output=15.0)
    for index, fake in enumerate(fakes):
        fake.script = _script(index)
    config = harvest_config(fakes, retries=3)  # the default timeout: no request here comes near it
    return fakes, config


def _states():
    return [State(i, p, s) for i, p, s in STUDENT]


def _core(pairs):
    return [(p["prompt"], p["chosen"], p["rejected"], p["provenance"]["states"]) for p in pairs]


def _harvest(config, cache_dir, max_usd=10.0):
    return asyncio.run(
        harvest(_states(), config, AnswerCache(ObjectStore(str(cache_dir))), Budget(Fraction(max_usd)))
    )


def test_the_pairs_are_the_scripted_majority_through_every_failure(scripted, tmp_path, caplog):
    fakes, config = scripted
    caplog.set_level("INFO")
    result = _harvest(config, tmp_path / "cache")

    assert _core(result.pairs) == EXPECTED_PAIRS
    assert result.verdicts == {"agreed": 9, "below threshold": 1}
    assert result.student_agreed == 3  # s1, s6 and s10 gave the agreed answer (s5's prompt has none)

    # Every scripted failure was retried exactly as scripted; the dropped request four times in all.
    for (index, prompt), before in TROUBLE.items():
        assert fakes[index].attempts[prompt] == len(before) + 1, (index, prompt)
    assert fakes[2].attempts["p9"] == 4
    stats = {t.name: t for t in result.teachers}
    assert (stats["t0"].requests, stats["t0"].failed, stats["t0"].answered) == (13, 3, 10)
    assert (stats["t1"].requests, stats["t1"].failed) == (13, 3)
    assert (stats["t2"].requests, stats["t2"].failed, stats["t2"].unanswered) == (14, 5, 1)

    # A 429 pauses the teacher for its Retry-After: its next request comes at least 1 s later.
    seen = [s for s in fakes[0].seen if s.prompt == "p1"]
    assert [s.status for s in seen] == [429, 200] and seen[1].time - seen[0].time >= 1.0

    # Charged what the servers billed, except where the bill could not be known: the answer without usage
    # and the cut-off one at their worst case, and each dropped request (the server may have billed it).
    t0_billed = fakes[0].billed
    assert stats["t0"].usd == t0_billed
    p5 = request_body(config, config.teachers[1], "p5")
    actual = Price.of(config.teachers[1]).cost(fakes[1].tokens_in([{"content": "p5"}]), 1)
    assert stats["t1"].usd == fakes[1].billed - actual + worst_case(p5, config.teachers[1])
    assert result.spent == sum(t.usd for t in stats.values()) >= sum(f.billed for f in fakes)

    # The key went only into the Authorization header: every request was authorised, no log line holds it.
    assert all(s.authorized for f in fakes for s in f.seen)
    assert CANARY not in caplog.text
    assert "retry 1 of 3" in caplog.text and "gave up after 4 attempts" in caplog.text
    # Each logical request keeps one idempotency key across its retries.
    keys = {s.idempotency_key for s in fakes[1].seen if s.prompt == "p2"}
    assert len(keys) == 1 and None not in keys


def test_a_second_run_costs_nothing_and_sends_nothing(scripted, tmp_path):
    fakes, config = scripted
    first = _harvest(config, tmp_path / "cache")
    sent = [sum(f.attempts.values()) for f in fakes]
    again = _harvest(config, tmp_path / "cache")
    # Only what was never answered (p9, by the teacher that drops it) is asked again.
    assert [sum(f.attempts.values()) for f in fakes] == [sent[0], sent[1], sent[2] + 4]
    assert [t.cached for t in again.teachers] == [10, 10, 9] and _core(again.pairs) == _core(first.pairs)
    assert {t["outcome"] for p in again.pairs for t in p["provenance"]["teachers"].values()} <= {
        "cached",
        "failed",
    }
    # Saved: what the cached answers cost, i.e. the first run's spend less the requests that brought none:
    # the cut-off answer and the four dropped ones at their worst case, the answer without choices at its usage
    # (the fake's "ok", 2 tokens).
    t0, t2 = config.teachers[0], config.teachers[2]
    failed = worst_case(request_body(config, t2, "p3"), t2) + 4 * worst_case(
        request_body(config, t2, "p9"), t2
    )
    failed += Price.of(t0).cost(fakes[0].tokens_in([{"content": "p4"}]), 2)
    assert again.saved_usd == pytest.approx(float(first.spent - failed), rel=1e-12)

    answered = [s for s in _states() if s.prompt != "p9"]
    before = [len(f.seen) for f in fakes]
    cached = asyncio.run(
        harvest(answered, config, AnswerCache(ObjectStore(str(tmp_path / "cache"))), Budget(Fraction(10)))
    )
    assert cached.spent == 0 and [len(f.seen) for f in fakes] == before
    assert [t.requests for t in cached.teachers] == [0, 0, 0]
    # Nothing in the cache holds the key; each entry is JSON naming the request it answers, under its hash.
    cache = ObjectStore(str(tmp_path / "cache"))
    names = cache.list_tree()
    assert len(names) == 29
    for name in names:
        data = cache.get(name)
        assert CANARY.encode() not in data
        entry = json.loads(data)
        teacher = next(t for t in config.teachers if t.model == entry["model"])
        body = request_body(config, teacher, entry["request"]["messages"][-1]["content"])
        assert name == layout.cache_entry(cache_key(teacher, body))


def test_a_request_slower_than_the_timeout_is_given_up_on_at_its_worst_case(
    teachers, tmp_path, monkeypatch, quick_backoff
):
    """The harvest's one request is held by the server until the test ends: every attempt times out, however
    fast or slow the machine, and each is charged its worst case (the server may bill it after the client
    left)."""
    monkeypatch.setenv("TEACHER_KEY", CANARY)
    released = threading.Event()
    (fake,) = teachers(
        1,
        key=CANARY,
        usd_per_m_input=3.0,
        usd_per_m_output=15.0,
        script=lambda prompt, attempt: Behaviour(answer="N", hold=released),
    )
    config = harvest_config([fake], threshold=1, timeout_s=0.2, retries=1)
    try:
        result = asyncio.run(
            harvest(
                [State("s", "p", "x")],
                config,
                AnswerCache(ObjectStore(str(tmp_path / "cache"))),
                Budget(Fraction(10)),
            )
        )
    finally:
        released.set()
    (stats,) = result.teachers
    assert (stats.requests, stats.failed, stats.answered, stats.unanswered) == (2, 2, 0, 1)
    assert (
        result.spent
        == stats.usd
        == 2 * worst_case(request_body(config, config.teachers[0], "p"), config.teachers[0])
    )
    assert not result.pairs

"""One harvest: every selected prompt asked of every teacher in parallel, their answers voted on, and a pair
made wherever the student's answer differs from the agreed one.

Each teacher keeps ``concurrency`` requests in flight (``client.TeacherClient``); all teachers run at once, so
with a fixed latency the harvest takes about ``ceil(prompts / concurrency)`` latencies, not that times the
number of teachers. A prompt asked before with the same request is answered from the cache and costs
nothing; an answer is cached as soon as it arrives, so an interrupted harvest loses none it paid for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any
from urllib.parse import urlsplit

import httpx

from composer_serverless.config import HarvestConfig, TeacherConfig
from composer_serverless.data.records import Prompt
from composer_serverless.harvest.answers import normalise, normalise_student, vote
from composer_serverless.harvest.cache import AnswerCache, CachedAnswer, cache_key
from composer_serverless.harvest.client import Reply, TeacherClient
from composer_serverless.harvest.conversation import openai_messages
from composer_serverless.harvest.costs import Budget, worst_case
from composer_serverless.harvest.states import State, select_states
from composer_serverless.harvest.stats import HarvestResult, TeacherStats

# Called after every prompt-teacher query: (queries done, queries in all, USD spent so far).
Progress = Callable[[int, int, float], None]


def messages(config: HarvestConfig, prompt: Prompt) -> list[dict[str, Any]]:
    """What a teacher reads: a text prompt in the harvest's template (after its system turn), or a trace's
    state as it is, the conversation the student saw (its own system turn included), to be continued."""
    if not isinstance(prompt, str):
        return openai_messages(prompt)
    system = [{"role": "system", "content": config.system}] if config.system else []
    return [*system, {"role": "user", "content": config.template.format(prompt=prompt)}]


def request_body(
    config: HarvestConfig, teacher: TeacherConfig, prompt: Prompt, tools: Sequence[dict[str, Any]] = ()
) -> bytes:
    """The exact bytes sent to ``teacher`` for ``prompt`` (compact JSON, keys sorted: one request, one body,
    one cache key); a state's tools go as the API's ``tools``, so the teacher may call them as the student
    could."""
    body: dict[str, Any] = {
        "model": teacher.model,
        "messages": messages(config, prompt),
        teacher.max_tokens_field: teacher.max_tokens,
    }
    if tools:
        body["tools"] = list(tools)
    if teacher.temperature is not None:
        body["temperature"] = teacher.temperature
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Asked:
    """One teacher's answer to one prompt, wherever it came from."""

    content: str | None
    outcome: str  # "answered", "cached", "failed", "refused", "disabled"
    usd: Fraction
    latency_s: float | None


class _Harvest:
    def __init__(
        self,
        config: HarvestConfig,
        cache: AnswerCache,
        budget: Budget,
        http: dict[str, httpx.AsyncClient],
        progress: Progress | None,
        seed: int | None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.budget = budget
        rng = random.Random(seed)
        self.clients = {t.name: TeacherClient(t, http[t.name], config, rng) for t in config.teachers}
        self.stats = {t.name: TeacherStats(t.name) for t in config.teachers}
        self.progress = progress
        self.done = 0
        self.total = 0

    async def ask(self, teacher: TeacherConfig, state: State) -> Asked:
        body = request_body(self.config, teacher, state.prompt, state.tools)
        digest = cache_key(teacher, body)
        stats = self.stats[teacher.name]
        hit = await self.cache.aget(digest)
        if hit is not None:
            stats.cached += 1
            stats.saved_usd += hit.usd
            asked = Asked(hit.content, "cached", Fraction(0), hit.latency_s)
        else:
            reply = await self.clients[teacher.name].ask(body, worst_case(body, teacher), self.budget)
            self._record(stats, reply)
            if reply.outcome == "answered" and reply.completion is not None:
                completion = reply.completion
                entry = CachedAnswer(
                    completion.content,
                    completion.usage,
                    float(reply.attempts[-1].usd),
                    reply.latency_s or 0.0,
                    completion.model,
                    completion.finish_reason,
                )
                await self.cache.aput(digest, entry, teacher, body)
                asked = Asked(completion.content, "answered", reply.usd, reply.latency_s)
            else:
                asked = Asked(None, reply.outcome, reply.usd, None)
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, float(self.budget.spent))
        return asked

    def _record(self, stats: TeacherStats, reply: Reply) -> None:
        stats.requests += len(reply.attempts)
        for attempt in reply.attempts:
            stats.failed += not attempt.ok
            stats.tokens_in += attempt.tokens_in
            stats.tokens_out += attempt.tokens_out
            stats.usd += attempt.usd
            if attempt.ok:
                stats.latencies_s.append(attempt.latency_s)
        if reply.outcome == "answered":
            stats.answered += 1
        else:
            stats.unanswered += 1
        if reply.outcome == "disabled" and stats.disabled is None:
            stats.disabled = reply.error


def _provenance(
    config: HarvestConfig, asked: dict[str, Asked], verdict_votes: int, voters: tuple[str, ...], answered: int
) -> dict[str, Any]:
    teachers = {}
    for teacher in config.teachers:
        a = asked[teacher.name]
        answer = None if a.content is None else normalise(a.content, config.normalise)
        teachers[teacher.name] = {
            "model": teacher.model,
            "outcome": a.outcome,
            "answer": a.content,
            "normalised": None if answer is None else answer.text,
            "usd": float(a.usd),
            "latency_s": a.latency_s,
        }
    latencies = [a.latency_s for a in asked.values() if a.latency_s is not None]
    return {
        "teachers": teachers,
        "agreement": {
            "votes": verdict_votes,
            "voters": list(voters),
            "answered": answered,
            "teachers": len(config.teachers),
            "threshold": config.threshold,
        },
        "usd": float(sum((a.usd for a in asked.values()), Fraction(0))),
        "latency_s": max(latencies, default=None),
    }


def make_pairs(
    config: HarvestConfig, states: list[State], asked: list[State], answers: dict[str, dict[str, Asked]]
) -> tuple[list[dict[str, Any]], Counter[str], int]:
    """The pairs, the verdict per question asked and how many states already gave the agreed answer.

    A pair is ``{prompt, chosen, rejected, provenance}`` (and ``tools`` for a trace's state): chosen is the
    answer ``threshold`` teachers agree on, rejected the student's answer as it was given; states with the
    same question (``State.key``) and student answer make one pair, which names them all
    (``provenance.states``). A trace's state is one question of its own, so its pairs are per state."""
    rule = config.normalise
    by_key: dict[str, list[State]] = {}
    for state in states:
        by_key.setdefault(state.key, []).append(state)
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    verdicts: Counter[str] = Counter()
    agreed = 0
    for question in asked:
        replies = answers[question.key]
        normalised = {
            name: None if a.content is None else normalise(a.content, rule) for name, a in replies.items()
        }
        verdict = vote(normalised, config.threshold)
        verdicts[verdict.reason] += 1
        if verdict.chosen is None:
            continue
        provenance = _provenance(config, replies, verdict.votes, verdict.voters, verdict.answered)
        for state in by_key[question.key]:
            if normalise_student(state.student, rule).key == verdict.key:
                agreed += 1
                continue
            pair = pairs.setdefault(
                (question.key, state.student),
                {
                    "prompt": state.prompt if isinstance(state.prompt, str) else list(state.prompt),
                    "chosen": verdict.chosen,
                    "rejected": state.student,
                    "provenance": {"states": [], **provenance},
                    **({"tools": list(state.tools)} if state.tools else {}),
                },
            )
            pair["provenance"]["states"].append(state.id)
    return list(pairs.values()), verdicts, agreed


async def harvest(
    states: list[State],
    config: HarvestConfig,
    cache: AnswerCache,
    budget: Budget,
    *,
    progress: Progress | None = None,
    seed: int | None = None,
) -> HarvestResult:
    """Ask the teachers about ``states`` under ``budget`` and return the pairs and the figures.

    Each teacher has a connection pool of its own, as large as its concurrency: one teacher's slow or dead
    connections never hold up another's, and httpx's pool, which scans its connections for every request it
    places, scans only those. An https teacher is asked through the proxy the environment names, if any
    (``HTTPS_PROXY``, ``ALL_PROXY``: a CONNECT tunnel, the key stays inside TLS); a plain-http one never is,
    since a proxy would read its key in clear (the config allows plain http with a key only to this machine).

    Args:
        seed: of the backoff jitter (None: from the system's randomness).
    """
    started = time.monotonic()
    spent_before = budget.spent
    asked = select_states(states, config.max_states)
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    tls = httpx.create_ssl_context()  # one for all: loading the CA bundle takes tens of milliseconds
    async with contextlib.AsyncExitStack() as stack:
        http = {}
        for t in config.teachers:
            limits = httpx.Limits(max_connections=t.concurrency, max_keepalive_connections=t.concurrency)
            proxied = urlsplit(t.base_url).scheme == "https"
            client = httpx.AsyncClient(limits=limits, timeout=timeout, verify=tls, trust_env=proxied)
            http[t.name] = await stack.enter_async_context(client)
        run = _Harvest(config, cache, budget, http, progress, seed)
        queries = [(state, teacher) for state in asked for teacher in config.teachers]
        run.total = len(queries)
        tasks = [asyncio.ensure_future(run.ask(teacher, state)) for state, teacher in queries]
        try:
            replies = await asyncio.gather(*tasks)
        except BaseException:
            # A query failed (the cache's store, say) or the harvest is cancelled: the other queries stop here,
            # before their clients close, rather than go on sending; each settles what it reserved.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    answers: dict[str, dict[str, Asked]] = {state.key: {} for state in asked}
    for (state, teacher), reply in zip(queries, replies, strict=True):
        answers[state.key][teacher.name] = reply
    pairs, verdicts, agreed = make_pairs(config, states, asked, answers)
    return HarvestResult(
        pairs=pairs,
        teachers=list(run.stats.values()),
        states=len(states),
        prompts=len(asked),
        verdicts=verdicts,
        student_agreed=agreed,
        spent=budget.spent - spent_before,
        spent_before=spent_before,
        max_usd=budget.max_usd,
        refused=budget.refused,
        stopped=budget.broken,
        wall_s=time.monotonic() - started,
    )


def pairs_jsonl(pairs: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs).encode()

"""The hard cap, randomised: over prices, latencies, answer lengths, failures and concurrency, what the
servers bill never exceeds max_usd, and neither does what the harvest counted (which is never less than the
bill); and the cap refuses a request only when it must. Every assertion holds in every trial, whatever the
order in which the requests happen to settle."""

from __future__ import annotations

import asyncio
import random
from fractions import Fraction

from composer_serverless.harvest.cache import AnswerCache
from composer_serverless.harvest.costs import Budget, worst_case
from composer_serverless.harvest.harvester import harvest, request_body
from composer_serverless.harvest.states import State
from composer_serverless.rendezvous.store import ObjectStore
from tests.harvest.conftest import harvest_config
from tests.harvest.fake_teacher import Behaviour

TRIALS = 16
PROMPTS = 24


def _behaviour(rng: random.Random) -> Behaviour:
    delay = rng.uniform(0, 0.01)
    roll = rng.random()
    if roll < 0.08:
        return Behaviour(status=429, retry_after_ms=str(rng.randrange(1, 15)), delay_s=delay)
    if roll < 0.14:
        return Behaviour(status=rng.choice([500, 502, 503]), delay_s=delay)
    if roll < 0.18:
        return Behaviour(malformed=True, answer="x" * rng.randrange(1, 90), delay_s=delay)
    return Behaviour(answer="y" * rng.randrange(1, 90), usage=rng.random() > 0.1, delay_s=delay)


def _script(rng: random.Random):
    return lambda prompt, attempt: _behaviour(rng)


def test_the_cap_is_never_exceeded(teachers, tmp_path, quick_backoff):
    rng = random.Random(20260501)
    fakes = teachers(3, key=None)
    for trial in range(TRIALS):
        for fake in fakes:
            fake.usd_per_m_input = rng.choice([0.05, 0.6, 3.0, 15.0, 75.0])
            fake.usd_per_m_output = rng.choice([0.2, 2.4, 15.0, 60.0, 150.0])
            fake.billed, fake.seen = Fraction(0), []
            fake.attempts.clear()
            fake.script = _script(random.Random(rng.random()))
        config = harvest_config(
            fakes,
            key_env=None,
            threshold=1,
            retries=2,
            teacher={"concurrency": rng.randrange(1, 9), "max_tokens": rng.randrange(8, 64)},
        )
        prompts = [f"trial {trial} prompt {i} " + "z" * rng.randrange(0, 300) for i in range(PROMPTS)]
        # A cap between a tenth and the whole of what every first attempt could cost at worst: it binds.
        worst = [worst_case(request_body(config, t, p), t) for t in config.teachers for p in prompts]
        cap = sum(worst) * Fraction(rng.randrange(10, 100), 100)
        budget = Budget(cap)
        states = [State(str(i), p, "student") for i, p in enumerate(prompts)]
        cache = AnswerCache(ObjectStore(str(tmp_path / f"cache-{trial}")))
        result = asyncio.run(harvest(states, config, cache, budget, seed=trial))
        billed = sum((f.billed for f in fakes), Fraction(0))
        assert billed <= result.spent <= cap, (trial, float(billed), float(result.spent), float(cap))
        assert budget.in_flight == 0
        # A request is refused only once the spend leaves it no room (spend only grows, so the final spend
        # shows it): never for requests merely in flight, which it waits for.
        assert result.refused == 0 or result.spent + max(worst) > cap, trial

"""A standalone harvest (``composer-serverless harvest CONFIG``): its states, cache and output found and
checked before any request is sent; what it may cost (``--dry-run``); running it and writing its pairs.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from composer_serverless.config import ConfigError, HarvestConfig, TeacherConfig
from composer_serverless.executors.opening import open_created, open_store
from composer_serverless.harvest.cache import AnswerCache, CachedAnswer, cache_key
from composer_serverless.harvest.client import UnusableKey, read_key
from composer_serverless.harvest.costs import Budget, Price, worst_case
from composer_serverless.harvest.harvester import Progress, harvest, messages, pairs_jsonl, request_body
from composer_serverless.harvest.states import (
    State,
    latest_rollout_round,
    read_rollouts,
    read_trace,
    select_states,
)
from composer_serverless.harvest.stats import HarvestResult
from composer_serverless.objectives.inputs import check_paths
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore, validate_key

# OpenAI's rule of thumb for English text (help.openai.com, "What are tokens"): about 4 characters a token;
# and its cookbook's count of the chat format: 3 tokens around each message, 3 to start the reply.
BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REPLY = 3
CACHE_READERS = 16


@dataclass
class Prepared:
    """A harvest ready to run: the states read, the cache and output opened, the keys looked for."""

    config: HarvestConfig
    states: list[State]
    source: str
    cache: AnswerCache
    output: ObjectStore
    output_name: str
    missing_keys: list[str]
    unusable_keys: list[str]

    @property
    def output_url(self) -> str:
        return self.output.url_of(self.output_name)


def check_keys(config: HarvestConfig) -> tuple[list[str], dict[str, str]]:
    """The environment variables a teacher names for its key that are unset or blank here, and those whose key
    cannot be sent (``client.read_key``) with why: names only, never a value."""
    missing: list[str] = []
    unusable: dict[str, str] = {}
    for name in dict.fromkeys(t.api_key_env for t in config.teachers if t.api_key_env):
        try:
            if read_key(name) is None:
                missing.append(name)
        except UnusableKey as e:
            unusable[name] = str(e)
    return missing, unusable


def key_problem(config: HarvestConfig) -> str | None:
    """What keeps the teachers' keys from being sent, with the fix; None when nothing does."""
    missing, unusable = check_keys(config)
    problems = [
        f"{why}\n  fix: export {name}=... with the key alone (the whitespace around it is dropped)"
        for name, why in unusable.items()
    ]
    if missing:
        exports = "; ".join(f"export {name}=..." for name in missing)
        problems.insert(
            0, f"the teachers' keys are not in the environment: {', '.join(missing)}\n  fix: {exports}"
        )
    return "\n".join(problems) or None


def prepare(config: HarvestConfig) -> Prepared:
    """Read the states and open the cache and the output's location.

    Raises:
        ConfigError: no states or output configured, a state is malformed, the run has no rollouts, a URL
            is not a store.
    """
    if config.live:
        raise ConfigError(
            "harvest.live = true harvests inside `composer-serverless launch`, between the run's rounds\n"
            "  fix: for a harvest of its own, --set harvest.live=false and set harvest.traces or harvest.run, "
            "and harvest.output"
        )
    if config.output is None:
        raise ConfigError(
            "harvest.output is not set\n  fix: --set harvest.output=pairs.jsonl (a path or URL)"
        )
    cache_store: ObjectStore | None = None
    if config.cache is not None:
        cache_store = open_store(config.cache, fix="harvest.cache: a directory or a store URL")
    if config.run is not None:
        run, _ = open_created(config.run)
        round_index = latest_rollout_round(run)
        if round_index == 0:
            raise ConfigError(
                f"the run at {config.run} has no recorded rollouts\n  fix: runs record them with "
                "composer.record_rollouts = true (or a live harvest)"
            )
        states, source = _read(lambda: read_rollouts(run, round_index)), f"{run.url}, round {round_index}"
        cache_store = cache_store or run.child(layout.HARVEST_CACHE)
    elif config.traces is not None:
        check_paths({"harvest.traces": config.traces})
        states, source = _read(lambda: read_trace(config.traces or "")), config.traces
    else:
        raise ConfigError(
            "no states: set harvest.traces (a trace file) or harvest.run (a run whose rollouts to read)"
        )
    if cache_store is None:
        raise ConfigError(
            "harvest.cache is not set\n  fix: --set harvest.cache=runs/harvest-cache (a directory or store URL)"
        )
    where, _, name = config.output.rpartition("/")
    try:
        validate_key(name)
    except ValueError:
        raise ConfigError(f"harvest.output {config.output!r} does not end in a file name") from None
    output = open_store(where or ".", fix="harvest.output: a .jsonl path or URL")
    missing, unusable = check_keys(config)
    return Prepared(config, states, source, AnswerCache(cache_store), output, name, missing, list(unusable))


def _read(read: Any) -> list[State]:
    try:
        states = read()
    except (OSError, ValueError) as e:  # RecordError is a ValueError
        raise ConfigError(f"harvest states: {e}") from e
    if not states:
        raise ConfigError("harvest states: none were found")
    return states


@dataclass
class TeacherEstimate:
    """What one teacher may cost: ``worst_usd`` is the cap's own bound, ``expected_usd`` a guess (see
    ``estimate``)."""

    name: str
    queries: int
    cached: int
    worst_usd: Fraction
    expected_usd: float
    output_basis: str


def _expected(config: HarvestConfig, teacher: TeacherConfig, state: State, output_tokens: float) -> float:
    sent = messages(config, state.prompt)
    text_bytes = sum(len(m["content"].encode()) for m in sent)
    tokens_in = text_bytes / BYTES_PER_TOKEN + TOKENS_PER_MESSAGE * len(sent) + TOKENS_PER_REPLY
    price = Price.of(teacher)
    return float(tokens_in * price.per_input + Fraction(output_tokens) * price.per_output)


def estimate(prepared: Prepared) -> list[TeacherEstimate]:
    """Per teacher: the prompts to ask, how many the cache answers, the worst case of the rest (what the cap
    reserves) and an expected cost: input at about 4 bytes a token, output at the mean of the teacher's
    cached answers (or max_tokens when it has none cached). Reads the cache; sends nothing."""
    config = prepared.config
    prompts = select_states(prepared.states, config.max_states)
    out = []
    with ThreadPoolExecutor(CACHE_READERS) as pool:
        for teacher in config.teachers:
            bodies = [request_body(config, teacher, p.prompt, p.tools) for p in prompts]
            hits: list[CachedAnswer | None] = list(
                pool.map(prepared.cache.get, [cache_key(teacher, b) for b in bodies])
            )
            outputs = [h.usage[1] for h in hits if h is not None and h.usage is not None]
            output_tokens = sum(outputs) / len(outputs) if outputs else float(teacher.max_tokens)
            basis = f"mean of {len(outputs)} cached answers" if outputs else "max_tokens (none cached)"
            todo = [(p, b) for p, b, h in zip(prompts, bodies, hits, strict=True) if h is None]
            out.append(
                TeacherEstimate(
                    teacher.name,
                    len(prompts),
                    len(prompts) - len(todo),
                    sum((worst_case(b, teacher) for _, b in todo), Fraction(0)),
                    sum(_expected(config, teacher, p, output_tokens) for p, _ in todo),
                    basis,
                )
            )
    return out


def plan_json(prepared: Prepared, estimates: list[TeacherEstimate]) -> dict[str, Any]:
    """The dry run's plan: where everything is, each teacher (its key by the variable's name only) and the
    estimate."""
    config = prepared.config
    by_name = {e.name: e for e in estimates}
    return {
        "states": len(prepared.states),
        "source": prepared.source,
        "prompts": len(select_states(prepared.states, config.max_states)),
        "output": prepared.output_url,
        "cache": prepared.cache.store.url,
        "threshold": config.threshold,
        "max_usd": config.max_usd,
        "teachers": [
            {
                "name": t.name,
                "base_url": t.base_url,
                "model": t.model,
                "api_key_env": t.api_key_env,
                "usd_per_m_input": t.usd_per_m_input,
                "usd_per_m_output": t.usd_per_m_output,
                "concurrency": t.concurrency,
                "max_tokens": t.max_tokens,
                "queries": by_name[t.name].queries,
                "cached": by_name[t.name].cached,
                "worst_usd": float(by_name[t.name].worst_usd),
                "expected_usd": by_name[t.name].expected_usd,
                "expected_output": by_name[t.name].output_basis,
            }
            for t in config.teachers
        ],
        "worst_usd": float(sum((e.worst_usd for e in estimates), Fraction(0))),
        "expected_usd": sum(e.expected_usd for e in estimates),
        "missing_keys": prepared.missing_keys,
        "unusable_keys": prepared.unusable_keys,
    }


def run(prepared: Prepared, progress: Progress | None = None) -> HarvestResult:
    """Run the harvest under a cap of ``max_usd`` and write its pairs to the output.

    Raises:
        ConfigError: a teacher's key is not in the environment, or cannot be sent (nothing was sent).
    """
    problem = key_problem(prepared.config)
    if problem is not None:
        raise ConfigError(problem)
    budget = Budget(Fraction(prepared.config.max_usd))
    result = asyncio.run(harvest(prepared.states, prepared.config, prepared.cache, budget, progress=progress))
    prepared.output.put(prepared.output_name, pairs_jsonl(result.pairs))
    return result

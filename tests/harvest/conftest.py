"""Fixtures for the harvest tests: fake teachers on loopback, stopped after each test, and harvest configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from composer_serverless.config import HarvestConfig, RunConfig
from composer_serverless.harvest import client
from tests.harvest.fake_teacher import FakeTeacher
from tests.harvest.live_runs import TASKS, composer_live_config

LIVE_TEACHERS = ("careful", "steady", "sloppy")

# A known key value: tests scan everything a harvest leaves behind and must never find it.
CANARY = "sk-canary-DO-NOT-LEAK-5f1e9a77c3b2"


@pytest.fixture
def teachers():
    """``teachers(n, **options)``: n fake teachers (``FakeTeacher`` options), all stopped at the end."""
    started: list[FakeTeacher] = []

    def make(count: int, **options: Any) -> list[FakeTeacher]:
        fakes = [FakeTeacher(**options) for _ in range(count)]
        started.extend(fakes)
        return fakes

    yield make
    for fake in started:
        fake.stop()


@pytest.fixture
def quick_backoff(monkeypatch):
    """Backoff from 5 ms instead of 0.5 s: the retry rules are unchanged, the tests just wait less."""
    monkeypatch.setattr(client, "INITIAL_RETRY_DELAY_S", 0.005)
    monkeypatch.setattr(client, "MAX_RETRY_DELAY_S", 0.02)


def harvest_config(
    fakes: list[FakeTeacher], key_env: str | None = "TEACHER_KEY", **overrides: Any
) -> HarvestConfig:
    """A config asking ``fakes`` (teachers t0, t1, ...), 2 of 3 agreeing by default, $10 cap."""
    teacher_options = overrides.pop("teacher", {})
    raw: dict[str, Any] = {
        "teachers": [
            {
                "name": f"t{i}",
                "base_url": fake.base_url,
                "model": f"model-{i}",
                "api_key_env": key_env,
                "usd_per_m_input": fake.usd_per_m_input,
                "usd_per_m_output": fake.usd_per_m_output,
                "concurrency": 4,
                "max_tokens": 16,
                **teacher_options,
            }
            for i, fake in enumerate(fakes)
        ],
        "threshold": 2,
        "max_usd": 10.0,
        "retries": 4,
        **overrides,
    }
    return HarvestConfig.model_validate(raw)


def right_answers() -> dict[str, str]:
    """The task suite's training prompts and their right answers."""
    rows = [json.loads(line) for line in (TASKS / "train.jsonl").read_text().splitlines()]
    return {row["prompt"]: row["answer"] for row in rows}


def live_run_config(
    fakes: list[FakeTeacher], store: Path, run_id: str, rounds: int, **harvest: Any
) -> RunConfig:
    """A 2-replica composer run of a tiny model on the task suite, harvested live from ``fakes`` (teachers
    careful, steady and sloppy, key in TEACHER_KEY, answers compared as "answer is X")."""
    teachers = [
        {
            "name": name,
            "base_url": fake.base_url,
            "model": f"model-{name}",
            "api_key_env": "TEACHER_KEY",
            "usd_per_m_input": fake.usd_per_m_input,
            "usd_per_m_output": fake.usd_per_m_output,
            "max_tokens": 32,
        }
        for name, fake in zip(LIVE_TEACHERS, fakes, strict=True)
    ]
    normalise = {"final_answer": r"answer is\s*(\S+)", "trim_chars": "."}
    return composer_live_config(teachers, store, run_id, rounds, normalise=normalise, **harvest)

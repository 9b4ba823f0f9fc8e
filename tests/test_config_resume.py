"""What ``launch --resume RUN --set`` may change (``config/resume.py``): the sorting of changed keys, the
refusal message, the cosine note, and the documentation's tables of the keys."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from composer_serverless.config import RunConfig, apply_override, load_config, validate_config
from composer_serverless.config.resume import (
    _UNLISTED,
    ALLOWED,
    REFUSED,
    _leaves,
    _refusal,
    cosine_note,
    refusal_message,
    sort_changes,
)

ROOT = Path(__file__).resolve().parents[1]
RUN = {
    "run_id": "r",
    "model": {"path": "some/model"},
    "diloco": {"replicas": 2, "sync_every": 4, "rounds": 4},
}


def _config(*overrides: str, raw: dict[str, Any] | None = None) -> RunConfig:
    tree = json.loads(validate_config(raw or RUN).resolved_json())
    for override in overrides:
        apply_override(tree, override)
    return validate_config(tree)


@pytest.mark.parametrize(
    "override",
    [
        "diloco.rounds=6",
        "train.lr=0.001",
        "eval.every_rounds=5",
        "diloco.checkpoint_every=3",
        "diloco.keep_checkpoints=4",
        "diloco.sync_timeout_s=900",
        "diloco.transfer_concurrency=16",
        "diloco.verify_global=false",
        "tracking.report_to=['tensorboard']",
        "output.push_to_hub='me/model'",
        "executor.threads_per_replica=2",
        "executor.max_restarts=3",
    ],
)
def test_a_resume_may_change(override: str) -> None:
    changes = sort_changes(_config(), _config(override))
    key = override.partition("=")[0]
    assert key in changes.changed and not changes.refused


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("model.dtype='bfloat16'", "the saved states"),
        ("data.batch_size=16", "the data order"),
        ("seed=1", "the data order"),
        ("diloco.replicas=3", "belong to its rank"),
        ("diloco.sync_every=8", "round boundary of this schedule"),
        ("diloco.fragments=2", "split into these fragments"),
        ("diloco.codec='int8'", "what every round averages"),
        ("diloco.outer_lr=0.5", "the outer optimizer's saved state carries it"),
        ("diloco.outer_momentum=0.8", "the outer optimizer's saved state carries it"),
        ("train.betas=[0.9, 0.99]", "the inner optimizer's saved state"),
        ("train.schedule='constant'", "a step of this schedule"),
        ("train.grad_clip=0.5", "what every inner step computes"),
        ("eval.sequences=8", "would not compare"),
        ("executor={type='modal'}", "status and cancel reach them"),
        ("executor.ranks_per_replica=2", "ranks per replica (1 -> 2)"),
        ("diloco.rounds=3", "only extends a run: it was set to 4 rounds"),
    ],
)
def test_a_resume_refuses_with_the_reason(override: str, reason: str) -> None:
    changes = sort_changes(_config(), _config(override))
    key = "executor.type" if override.startswith("executor=") else override.partition("=")[0]
    assert reason in changes.refused[key]
    message = refusal_message(changes.refused)
    assert f"  {key}: {changes.refused[key]}" in message
    assert "composer-serverless export RUN OUT" in message and "train.lr" in message


def test_a_run_with_a_live_harvest_keeps_its_length() -> None:
    """Which round's pairs each round's end takes is laid out over the run's length (harvest_schedule.py)."""
    from tests.harvest.live_runs import composer_live_config

    teacher = {
        "name": "t",
        "model": "m",
        "base_url": "http://t/v1",
        "usd_per_m_input": 1,
        "usd_per_m_output": 1,
    }
    live = json.loads(
        composer_live_config([teacher, {**teacher, "name": "u", "model": "n"}], ROOT, "r", 4).resolved_json()
    )
    changes = sort_changes(_config(raw=live), _config("diloco.rounds=6", raw=live))
    assert "the last rounds already run took none" in changes.refused["diloco.rounds"]


@pytest.mark.parametrize(
    "name", ["local-demo", "local-composer", "modal-demo", "hf-jobs-demo", "gsm8k-qwen2.5-0.5b"]
)
def test_every_key_of_the_shipped_configs_is_decided_explicitly(name: str) -> None:
    """A key under no entry of ALLOWED or REFUSED is refused as 'not among the keys a resume may change', a safe
    default; every key of the shipped configs (every table, every backend) has a reason of its own."""
    config = load_config(ROOT / "deploy" / "configs" / f"{name}.toml")
    undecided = [key for key in _leaves(config.model_dump(mode="json")) if _refusal(key) == _UNLISTED]
    assert not undecided


def test_the_cosine_note_says_the_schedule_follows_the_new_length() -> None:
    note = cosine_note(_config(), _config("diloco.rounds=6"), 4)
    assert note is not None and "from round 5 on" in note and "a 6-round run" in note
    constant = _config("train.schedule='constant'")
    assert cosine_note(constant, _config("train.schedule='constant'", "diloco.rounds=6"), 4) is None
    assert cosine_note(_config(), _config("train.lr=0.01"), 4) is None


def _documented(heading: str) -> list[tuple[tuple[str, ...], str]]:
    """The table under ``heading`` in docs/executors.md: (keys, why) per row."""
    text = (ROOT / "docs" / "executors.md").read_text()
    section = text[text.index(heading) :]
    table = section[section.index("\n| ") :].split("\n\n", 1)[0]
    rows = [
        line.removeprefix("| ").removesuffix(" |").split(" | ") for line in table.strip().splitlines()[2:]
    ]
    return [(tuple(re.findall(r"`([^`]+)`", keys)), why) for keys, why in rows]


def _grouped(rules: dict[str, str]) -> list[tuple[tuple[str, ...], str]]:
    """The rules as the documentation groups them: the keys sharing a reason on one row, in order."""
    groups: dict[str, list[str]] = {}
    for key, why in rules.items():
        groups.setdefault(why, []).append(key)
    return [(tuple(keys), why) for why, keys in groups.items()]


def test_the_documented_tables_are_the_rules() -> None:
    assert _documented("Keys a resume may change") == _grouped(ALLOWED)
    assert _documented("Keys a resume refuses") == _grouped(REFUSED)

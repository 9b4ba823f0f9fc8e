"""The [harvest] table: what validates, and what each mistake says."""

from __future__ import annotations

import copy
import json

import pytest

from composer_serverless.config import ConfigError, validate_config

TEACHER = {
    "name": "a",
    "base_url": "https://api.example.com/v1/",
    "model": "m",
    "api_key_env": "EXAMPLE_KEY",
    "usd_per_m_input": 1.0,
    "usd_per_m_output": 2.0,
}
RUN = {
    "model": {"tiny": {"tokenizer": "chars"}},
    "train": {"objective": "composer"},
    "diloco": {"sync_every": 2, "rounds": 3},
    "composer": {
        "beta": 1.0,
        "data": {"prompts": "train.jsonl", "heldout": "heldout.jsonl"},
        "rewards": [{"fn": "exact_match"}],
    },
    "harvest": {"teachers": [TEACHER, {**TEACHER, "name": "b", "model": "n"}], "max_usd": 5, "live": True},
}


def _edited(path: str, value):
    raw = copy.deepcopy(RUN)
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return raw


def test_a_live_harvest_feeds_a_replay_channel_without_a_pairs_file():
    config = validate_config(RUN)
    assert config.live_harvest and config.composer.data.pairs is None
    assert config.harvest.teachers[0].base_url == "https://api.example.com/v1"  # the trailing slash goes
    assert config.harvest.threshold == 2 and config.harvest.teachers[0].max_tokens == 256
    assert (config.harvest.live_lag, config.harvest.live_wait_s) == (1, 600.0)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("harvest.live", False, "composer.beta > 0 needs preference pairs"),
        ("composer.beta", 0.0, "harvest.live feeds the replay channel"),
        ("harvest.threshold", 3, "threshold (3) exceeds the 2 teachers"),
        ("harvest.teachers.1.name", "a", "teacher names must be unique"),
        ("harvest.teachers.1.model", "m", "one teacher asked twice would vote twice"),
        ("harvest.teachers.0.base_url", "ftp://x/v1", "is not an http(s) URL"),
        ("harvest.teachers.0.base_url", "https://user:pw@x/v1", "credentials in the URL"),
        ("harvest.teachers.0.base_url", "http://10.0.0.5:8000/v1", "would cross the network unencrypted"),
        ("harvest.teachers.0.api_key_env", "my key", "must be the NAME of an environment variable"),
        ("harvest.teachers.0.usd_per_m_input", -1, "greater than or equal to 0"),
        ("harvest.normalise", {"final_answer": "(a)(b)"}, "use at most one (the answer)"),
        ("harvest.normalise", {"final_answer": "("}, "not a valid regular expression"),
        ("harvest.template", "{question}", "may use only {prompt}"),
        ("harvest.output", "pairs.json", "ending in .jsonl"),
        ("harvest.max_usd", None, "harvest.max_usd: required but not set"),
        ("diloco.rounds", 2, "harvest.live_lag = 1 leaves no round to harvest in a run of 2 rounds"),
        ("harvest.live_lag", 2, "Set harvest.live_lag to at most 1, or diloco.rounds to at least 4"),
        ("harvest.live_lag", -1, "greater than or equal to 0"),
        ("harvest.live_wait_s", -5, "greater than or equal to 0"),
    ],
)
def test_mistakes_are_explained(path, value, message):
    with pytest.raises(ConfigError) as error:
        validate_config(_edited(path, value))
    assert message in str(error.value)


def test_plain_http_is_fine_on_loopback_or_without_a_key():
    validate_config(_edited("harvest.teachers.0.base_url", "http://127.0.0.1:8000/v1"))
    raw = _edited("harvest.teachers.0.base_url", "http://10.0.0.5:8000/v1")
    del raw["harvest"]["teachers"][0]["api_key_env"]
    validate_config(raw)


def test_live_and_a_source_of_its_own_exclude_each_other():
    raw = _edited("harvest.traces", "trace.jsonl")
    with pytest.raises(ConfigError, match="a live harvest reads the run's own rollouts"):
        validate_config(raw)


def test_the_shipped_example_dry_runs_offline_without_the_training_stack(monkeypatch):
    from tests.conftest import cli_in_fresh_process

    result, loaded = cli_in_fresh_process("harvest", "deploy/configs/harvest-teachers.toml", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert loaded == []
    plan = json.loads(result.stdout.rsplit("LOADED ", 1)[0])
    assert [t["name"] for t in plan["teachers"]] == ["openai", "gemini", "local"]
    assert plan["prompts"] == 200 and plan["worst_usd"] <= plan["max_usd"]


def test_a_launch_with_a_live_harvest_needs_the_keys_here(monkeypatch, tmp_path):
    from composer_serverless.launch.launcher import prepare

    tasks = "deploy/data/composer-tasks"
    raw = copy.deepcopy(RUN)
    raw["composer"]["data"] = {"prompts": f"{tasks}/train.jsonl", "heldout": f"{tasks}/heldout.jsonl"}
    raw["store"] = str(tmp_path)
    monkeypatch.delenv("EXAMPLE_KEY", raising=False)
    prepared = prepare(validate_config(raw), "live.toml")
    assert any("the teachers' keys are not in the environment: EXAMPLE_KEY" in p for p in prepared.problems)
    assert prepared.plan.resources["withheld_env"] == ["EXAMPLE_KEY"]
    monkeypatch.setenv("EXAMPLE_KEY", "sk-secret\tpart")  # no header may carry a tab inside the key
    problems = prepare(validate_config(raw), "live.toml").problems
    assert any("the key in EXAMPLE_KEY holds a character an HTTP header cannot carry" in p for p in problems)
    assert "sk-secret" not in "".join(problems)
    monkeypatch.setenv("EXAMPLE_KEY", "x\r\n")
    assert prepare(validate_config(raw), "live.toml").problems == []
    with pytest.raises(ConfigError, match="executor.secrets names EXAMPLE_KEY"):
        validate_config({**raw, "executor": {"type": "modal", "secrets": ["EXAMPLE_KEY"]}})


def test_what_the_model_check_validates_of_a_live_run_is_valid():
    """The model check validates a run's model, data and objective tables on their own: a live harvest's
    replay channel without a pairs file is valid only with the harvest table beside them."""
    from composer_serverless.launch.launcher import _CHECKED

    config = validate_config(RUN)
    checked = {k: v for k, v in json.loads(config.resolved_json()).items() if k in _CHECKED}
    assert validate_config({**checked, "executor": {"type": "local"}}).live_harvest

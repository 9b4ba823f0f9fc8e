"""A coding task on the built-in code environment, as a user configures it: no environment file and no reward
of their own, only ``environment = "builtin:code"`` and a ``tests`` column. A dataset without the column, or
an unknown built-in, exits 2 before anything is written; the task trains 2 local replicas x 1 round on the
simulated accelerator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from tests.environments.conftest import trained_rows

CONFIG = """
store = "runs"

[model]
path = "{model}"

[train]
objective = "composer"

[diloco]
replicas = 2
sync_every = 1
rounds = 1

[eval]
sequences = 2

[composer]
alpha = 1.0

[composer.data]
prompts = "./train.jsonl"
heldout = "./test.jsonl"

[composer.rollout]
group_size = 2
prompts_per_step = 2
max_new_tokens = 6

[composer.episodes]
environment = "{environment}"
max_turns = 2
max_tokens = 32
code_timeout_s = 2

[executor]
threads_per_replica = 1
"""


def write_task(root: Path, model: Path, environment: str = "builtin:code", column: str = "tests") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.jsonl", 4), ("test.jsonl", 2)):
        rows = [{"prompt": f"Define f returning {i}.", column: [f"assert f() == {i}"]} for i in range(count)]
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "task.toml"
    config.write_text(CONFIG.format(model=model, environment=environment))
    return config


@pytest.mark.parametrize(
    ("environment", "column", "message"),
    [
        (
            "builtin:shell",
            "tests",
            "'builtin:shell' is no built-in environment; the built-ins are: builtin:code",
        ),
        (
            "builtin:code",
            "checks",
            "train.jsonl:1: builtin:code needs a 'tests' column on every row, a list of Python snippets "
            "(usually asserts) the submitted code must pass; this row has None\n"
            '    fix: add the column, or map yours to it: [composer.data.columns] tests = "<its name>"',
        ),
    ],
)
def test_an_unknown_builtin_or_a_dataset_without_tests_exits_2_before_anything_is_written(
    tmp_path, tool_chat_model_dir, capsys, monkeypatch, environment, column, message
):
    config = write_task(tmp_path / "task", tool_chat_model_dir, environment, column)
    monkeypatch.chdir(config.parent)
    assert cli_run(["launch", str(config), "--set", "run_id=code"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "task" / "runs").exists()


@pytest.mark.slow
def test_the_builtin_code_environment_trains_two_replicas(tmp_path, tool_chat_model_dir, monkeypatch):
    trained = trained_rows(write_task(tmp_path / "task", tool_chat_model_dir), "code", 1, monkeypatch)
    assert all({"rollout/turns", "rollout/reward/tests_passed"} <= t.keys() for t in trained)
    # A random model calls no tool, never submits, and scores the environment's 0.
    assert all(t["rollout/reward/tests_passed"] == 0.0 for t in trained)

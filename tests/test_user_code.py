"""A replica that fails inside the user's own code (a reward) names the file and line, and the launcher says
to fix it first instead of offering a resume that would fail the same way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from composer_serverless.config import validate_config
from composer_serverless.objectives.rewards import load_user_reward
from composer_serverless.objectives.user_code import failed_at
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.test_own_task import write_task

# Passes the launcher's reward check (which calls it on a placeholder completion), then raises in training.
FAILING = """
def scored(prompts, completions, **kwargs):
    if "placeholder completion" in completions:
        return [0.0] * len(completions)
    return [share(c) for c in completions]


def share(completion):
    return len(completion) / 0
"""
FAILING_LINE = FAILING.splitlines().index("    return len(completion) / 0") + 1


def _config(root: Path, paths: list[str]) -> dict:
    return {
        "store": str(root / "runs"),
        "model": {"path": str(root / "model")},
        "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1},
        "train": {"objective": "composer"},
        "composer": {
            "data": {"prompts": "train.jsonl", "heldout": "test.jsonl"},
            "rewards": [{"fn": "task/rewards.py:scored"}],
        },
        "code": {"root": str(root), "paths": paths},
    }


def test_the_innermost_frame_in_a_shipped_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "helpers").mkdir()
    (tmp_path / "task" / "rewards.py").write_text(
        "from helpers.maths import share\n\ndef scored(prompts, completions, **kwargs):\n"
        "    return [share(c) for c in completions]\n"
    )
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "maths.py").write_text("def share(c):\n    return len(c) / 0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        # helpers/ shipped: the division in it; not shipped (so not the user's code as the run knows it):
        # the reward file's call of it.
        for paths, where in ((["helpers/"], "helpers/maths.py:2"), ([], "task/rewards.py:4")):
            config = validate_config(_config(tmp_path, paths))
            fn = load_user_reward("task/rewards.py:scored", tmp_path)
            with pytest.raises(ZeroDivisionError) as raised:
                fn(prompts=["p"], completions=["c"])
            assert failed_at(raised.value, config) == where
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "helpers" or m.startswith("helpers.")]:
            del sys.modules[name]


def test_a_failure_outside_the_users_code_names_nothing(tmp_path: Path) -> None:
    config = validate_config(_config(tmp_path, []))
    with pytest.raises(ValueError) as raised:
        json.loads("{")
    assert failed_at(raised.value, config) is None


@pytest.mark.slow
def test_a_reward_that_raises_in_training_names_its_line_and_says_to_fix_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_task(tmp_path, fn="scored", store=str(tmp_path / "runs"))
    (tmp_path / "my_task.py").write_text(FAILING)
    monkeypatch.chdir(tmp_path)
    argv = ["launch", str(config), "--set", "run_id=own", "--set", "executor.max_restarts=0"]
    with replicas_on_the_simulated_accelerator():
        assert cli_run(argv) == 1
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    run = tmp_path / "runs" / "own"
    assert ran_on_the_simulated_accelerator(run / "logs")
    assert (
        f"it failed in your code, at my_task.py:{FAILING_LINE} (ZeroDivisionError: division by zero) "
        f"fix: fix my_task.py:{FAILING_LINE} first (a resume with the code as it is fails the same way), then "
        f"composer-serverless launch --resume {run} --set code.accept_changes=true"
    ) in err
    assert "the run can continue from its latest state" not in err

    # As it says: fixed, the run resumes with the new code.
    (tmp_path / "my_task.py").write_text(FAILING.replace("len(completion) / 0", "len(completion) / 4"))
    with replicas_on_the_simulated_accelerator():
        assert cli_run(["launch", "--resume", str(run), "--set", "code.accept_changes=true"]) == 0, (
            capsys.readouterr().err
        )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_committed"] == 2
    assert [list(c["changes"]) for c in summary["config_changes"]] == [["code/my_task.py"]]

"""A TRL-style agent task as a user brings it: a tool file and an environment class next to the config in a
directory outside the repository. Wrong tools and environments exit 2 before anything is written; the task
trains 2 local replicas x 2 rounds on the simulated accelerator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator

TOOLS = '''
def lookup(key: str) -> str:
    """Look a key up in the directory.

    Args:
        key: the key to look up
    """
    return {"vault": "the code is the secret"}.get(key, "unknown")
'''
ENVIRONMENT = '''
class Vault:
    """One vault per episode: open it with the row's secret."""

    def __init__(self):
        self.secret = None
        self.opened = False

    def reset(self, secret, **row):
        self.secret = secret
        self.opened = False
        return " (a vault)"

    def open(self, code: str) -> str:
        """Try a code on the vault.

        Args:
            code: the code to try
        """
        self.opened = code == self.secret
        return "open" if self.opened else {"error": "wrong code", "hint": f"the code is {self.secret}"}

    def get_reward(self) -> float:
        return float(self.opened)
'''
CONFIG = """
store = "runs"

[model]
path = "{model}"

[train]
objective = "composer"

[diloco]
replicas = 2
sync_every = 2
rounds = 2

[eval]
sequences = 4

[composer]
alpha = 1.0

[composer.data]
prompts = "./train.jsonl"
heldout = "./test.jsonl"

[[composer.rewards]]
fn = "exact_match"

[composer.rollout]
group_size = 2
prompts_per_step = 2
max_new_tokens = 6

[composer.episodes]
tools = ["my_tools.py:lookup"]
environment = "my_env.py:Vault"
max_turns = 2
max_tokens = 48

[executor]
threads_per_replica = 1
"""


def write_task(root: Path, model: Path, tools: str = TOOLS, environment: str = ENVIRONMENT) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_tools.py").write_text(tools)
    (root / "my_env.py").write_text(environment)
    for name, count in (("train.jsonl", 8), ("test.jsonl", 4)):
        rows = [{"prompt": f"Open vault {i}.", "secret": str(i), "answer": str(i)} for i in range(count)]
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "task.toml"
    config.write_text(CONFIG.format(model=model))
    return config


@pytest.mark.parametrize(
    ("tools", "environment", "message"),
    [
        (
            TOOLS.replace("key: str", "key"),
            ENVIRONMENT,
            "tool 'my_tools.py:lookup' has no schema: Argument key is missing a type hint in function lookup\n"
            "    fix: give every argument a type hint and the function a docstring with an Args: section",
        ),
        (
            TOOLS,
            ENVIRONMENT.replace("def reset(", "def restart("),
            "environment 'my_env.py:Vault' has no reset method\n    fix: define reset(self, **row)",
        ),
        (
            "import no_such_module_here\n" + TOOLS,
            ENVIRONMENT,
            "'my_tools.py:lookup' does not import: ModuleNotFoundError: No module named 'no_such_module_here'",
        ),
        (
            TOOLS,
            ENVIRONMENT.replace("def reset(self, secret, **row)", "def reset(self, secret)"),
            "environment 'my_env.py:Vault': reset raised TypeError",
        ),
    ],
)
def test_a_tool_or_environment_that_cannot_be_used_exits_2_before_anything_is_written(
    tmp_path, tool_chat_model_dir, capsys, monkeypatch, tools, environment, message
):
    config = write_task(tmp_path / "task", tool_chat_model_dir, tools, environment)
    monkeypatch.chdir(config.parent)
    assert cli_run(["launch", str(config), "--set", "run_id=agent"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: the rewards, tools or environment cannot be used as configured:\n  ")
    assert message in out.err
    assert not (tmp_path / "task" / "runs").exists()


@pytest.mark.slow
def test_an_environment_class_and_a_tool_next_to_the_config_train_two_replicas(
    tmp_path, tool_chat_model_dir, monkeypatch
):
    config = write_task(tmp_path / "task", tool_chat_model_dir)
    monkeypatch.chdir(config.parent)
    with replicas_on_the_simulated_accelerator():
        assert cli_run(["launch", str(config), "--set", "run_id=agent"]) == 0
    run = tmp_path / "task" / "runs" / "agent"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    assert ran_on_the_simulated_accelerator(run / "logs")
    rows = [json.loads(p.read_text()) for p in sorted((run / "metrics" / "0").glob("*.json"))]
    trained = [r["train"] for r in rows if r["round"] > 0]
    assert trained and all(
        {"rollout/turns", "rollout/tool_calls", "rollout/reward/Vault"} <= t.keys() for t in trained
    )
    assert all(1 <= t["rollout/turns"] <= 2 for t in trained)

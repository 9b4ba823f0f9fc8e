"""A TRL-style agent task as a user brings it: a tool file and an environment class next to the config in a
directory outside the repository. Wrong tools and environments exit 2 before anything is written; the task
trains 2 local replicas x 2 rounds on the simulated accelerator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from composer_serverless.executors import shipment
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.environments.conftest import trained_rows

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

{rewards}
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
{executor}
{extra}"""
# A reward function beside the environment's own reward (left out, the environment owns the reward alone).
EXACT_MATCH = """
[[composer.rewards]]
fn = "exact_match"
"""


def write_task(
    root: Path,
    model: Path,
    tools: str = TOOLS,
    environment: str = ENVIRONMENT,
    rewards: str = EXACT_MATCH,
    executor: str = "threads_per_replica = 1",
    extra: str = "",
) -> Path:
    """The task under ``root``: the tool and environment files, the data and the config (its [executor]
    table's keys, and ``extra`` tables appended); returns the config."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_tools.py").write_text(tools)
    (root / "my_env.py").write_text(environment)
    for name, count in (("train.jsonl", 8), ("test.jsonl", 4)):
        rows = [{"prompt": f"Open vault {i}.", "secret": str(i), "answer": str(i)} for i in range(count)]
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "task.toml"
    config.write_text(CONFIG.format(model=model, rewards=rewards, executor=executor, extra=extra))
    return config


@pytest.mark.parametrize(
    ("tools", "environment", "rewards", "message"),
    [
        (
            TOOLS.replace("key: str", "key"),
            ENVIRONMENT,
            EXACT_MATCH,
            "tool 'my_tools.py:lookup' has no schema: Argument key is missing a type hint in function lookup\n"
            "    fix: give every argument a type hint and the function a docstring with an Args: section",
        ),
        (
            TOOLS,
            ENVIRONMENT.replace("def reset(", "def restart("),
            EXACT_MATCH,
            "environment 'my_env.py:Vault' has no reset method\n    fix: define reset(self, **row)",
        ),
        (
            "import no_such_module_here\n" + TOOLS,
            ENVIRONMENT,
            EXACT_MATCH,
            "'my_tools.py:lookup' does not import: ModuleNotFoundError: No module named 'no_such_module_here'",
        ),
        (
            TOOLS,
            ENVIRONMENT.replace("def reset(self, secret, **row)", "def reset(self, secret)"),
            EXACT_MATCH,
            "environment 'my_env.py:Vault': reset raised TypeError",
        ),
        (
            TOOLS,
            ENVIRONMENT.replace("def get_reward(", "def _score("),
            "",
            "environment 'my_env.py:Vault' has no get_reward method, and no reward function of non-zero "
            "weight is configured: nothing would score the episodes\n    fix: define get_reward(self)",
        ),
    ],
)
def test_a_tool_or_environment_that_cannot_be_used_exits_2_before_anything_is_written(
    tmp_path, tool_chat_model_dir, capsys, monkeypatch, tools, environment, rewards, message
):
    config = write_task(tmp_path / "task", tool_chat_model_dir, tools, environment, rewards)
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
    """No reward function: the environment owns the reward alone (TRL's environment-owned reward), and it is
    the whole reward the step's rows show."""
    trained = trained_rows(
        write_task(tmp_path / "task", tool_chat_model_dir, rewards=""), "agent", 2, monkeypatch
    )
    assert all({"rollout/turns", "rollout/tool_calls", "rollout/reward/Vault"} <= t.keys() for t in trained)
    assert all(1 <= t["rollout/turns"] <= 2 for t in trained)
    assert all(t["rollout/reward_mean"] == pytest.approx(t["rollout/reward/Vault"]) for t in trained)
    assert not any(key.startswith("rollout/reward/exact_match") for t in trained for key in t)


# The environment's own package (installed here, so the local run and the HF Jobs fake's pip find it).
REQUIREMENTS = '\n[code]\nrequirements = ["packaging>=20"]\n'


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["modal", "hf_jobs"])
def test_the_cloud_dry_runs_list_the_tool_and_environment_files_and_their_requirements(
    tmp_path, tool_chat_model_dir, capsys, monkeypatch, executor
):
    """What a Modal image is built with (and the image Modal's SDK would build from the plan) and what an HF
    Jobs replica fetches: the tool file and the environment file next to the config (named in
    [composer.episodes] only, never in [code] paths), and the packages the environment needs; nothing
    written."""
    config = write_task(tmp_path / "task", tool_chat_model_dir, extra=REQUIREMENTS)
    monkeypatch.chdir(tmp_path)
    args = ["launch", str(config), "--executor", executor, "--set", "store=s3://bucket/runs", "--dry-run"]
    assert cli_run(args) == 0, capsys.readouterr().err
    shipped = json.loads(capsys.readouterr().out)["resources"]["shipped"]
    assert shipped["root"] == str(tmp_path / "task")
    assert shipped["code"] == ["my_tools.py", "my_env.py"]
    assert shipped["requirements"] == ["packaging>=20"]
    assert shipped["how"] == {"modal": shipment.IMAGE, "hf_jobs": shipment.STORE}[executor]
    if executor == "modal":  # the image Modal's SDK would build from that plan mounts them and installs them
        from composer_serverless.executors.modal import replica_module
        from composer_serverless.executors.modal_image import REMOTE_CODE
        from tests.executors.test_images import _layers

        try:
            commands, mounts = _layers(replica_module(shipped).image)
        finally:
            replica_module({"code": [], "requirements": []})
        assert mounts == {
            f"{REMOTE_CODE}/{f}": str(tmp_path / "task" / f) for f in ("my_tools.py", "my_env.py")
        }
        assert [c for c in commands if "pip install" in c][-1] == "RUN python -m pip install 'packaging>=20'"
    assert sorted(p.name for p in (tmp_path / "task").iterdir()) == [
        "my_env.py",
        "my_tools.py",
        "task.toml",
        "test.jsonl",
        "train.jsonl",
    ]


@pytest.mark.slow
def test_a_sweep_over_an_episode_setting_runs_each_cell_with_its_value(
    tmp_path, tool_chat_model_dir, capsys, monkeypatch
):
    """Two cells of the agent task, one replica x one round each on the simulated accelerator, swept over
    the episodes' token budget: each cell's run.json holds its value, and its episodes kept to it (4 episodes
    a step of at most 2 model tokens each in the first cell; turns of up to 6 tokens in the second)."""
    config = write_task(tmp_path / "task", tool_chat_model_dir)
    monkeypatch.chdir(config.parent)
    args = ["sweep", str(config), "--grid", "composer.episodes.max_tokens=2,40"]
    args += ["--set", "run_id=grid", "--set", "diloco.replicas=1", "--set", "diloco.rounds=1"]
    with replicas_on_the_simulated_accelerator():
        assert cli_run(args) == 0, capsys.readouterr().err
    tokens = {}
    for index, budget in enumerate((2, 40)):
        run = tmp_path / "task" / "runs" / f"grid-c{index}"
        assert json.loads((run / "run.json").read_text())["composer"]["episodes"]["max_tokens"] == budget
        assert json.loads((run / "summary.json").read_text())["rounds_committed"] == 1
        assert ran_on_the_simulated_accelerator(run / "logs")
        row = json.loads((run / "metrics" / "0" / "000001.json").read_text())["train"]
        assert 1 <= row["rollout/turns"] <= 2
        tokens[budget] = row["rollout/tokens"]
    assert 4 <= tokens[2] <= 4 * 2 < tokens[40], tokens

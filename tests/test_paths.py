"""One rule for paths: a relative path in a config file is relative to that file, one given with --set to the
working directory; resolved once, at load time, so run.json holds absolute paths; the user's code may live
anywhere on this machine and ships with the layout it has here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from composer_serverless.config import apply_override, load_config, load_harvest_config
from composer_serverless.data.records import PromptRecord
from composer_serverless.executors import shipment
from composer_serverless.objectives.rewards import RewardSet
from composer_serverless.rendezvous import shipped
from composer_serverless.rendezvous.store import ObjectStore

REWARDS = """
from answer_parsing import last_number

def accuracy(prompts, completions, completion_ids, answer, **kwargs):
    return [float(last_number(c) == a) for c, a in zip(completions, answer)]
"""
HELPERS = """
import re

def last_number(text):
    numbers = re.findall(r"-?\\d+", text)
    return numbers[-1] if numbers else None
"""
CONFIG = """
run_id = "paths"
store = "../runs"

[model.tiny]
tokenizer = "chars"
alphabet = " +=0123456789"
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 4

[train]
objective = "composer"

[diloco]
replicas = 2
sync_every = 2
rounds = 1

[eval]
sequences = 4

[composer.data]
prompts = "train.jsonl"
heldout = "data/test.jsonl"

[[composer.rewards]]
fn = "../tasks/rewards.py:accuracy"

[composer.rollout]
group_size = 2
prompts_per_step = 2
max_new_tokens = 2

[code]
paths = ["../tasks/answer_parsing.py"]

[executor]
threads_per_replica = 1
"""


def write_project(root: Path) -> Path:
    """A layout users keep: configs/ beside tasks/ (the reward and its helper), the data next to the config;
    returns the config."""
    (root / "tasks").mkdir(parents=True)
    (root / "tasks" / "rewards.py").write_text(REWARDS)
    (root / "tasks" / "answer_parsing.py").write_text(HELPERS)
    (root / "configs" / "data").mkdir(parents=True)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(a + a)} for a in range(8)]
    for name in ("train.jsonl", "data/test.jsonl"):
        (root / "configs" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "configs" / "task.toml"
    config.write_text(CONFIG)
    return config


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The project under ``tmp_path/proj``, and the working directory another one, ``tmp_path/elsewhere``."""
    write_project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path / "proj"


def test_paths_in_the_file_are_relative_to_it_and_set_values_to_the_working_directory(project: Path) -> None:
    config = load_config(
        Path("..") / "proj" / "configs" / "task.toml",
        ["composer.data.pairs=pairs.jsonl", "tracking.dir=tb", "diloco.replicas=3"],
    )
    here = project.parent / "elsewhere"
    assert config.store == str(project / "runs")
    assert config.composer.data.prompts == str(project / "configs" / "train.jsonl")
    assert config.composer.data.heldout == str(project / "configs" / "data" / "test.jsonl")
    assert config.composer.data.pairs == str(here / "pairs.jsonl")
    assert config.tracking.dir == str(here / "tb")
    # The code lives beside the config's directory: named from the directory holding both, as shipped.
    assert config.code.root == str(project)
    assert config.code.paths == ("tasks/answer_parsing.py",)
    assert config.composer.rewards[0].fn == "tasks/rewards.py:accuracy"
    # Unset, the store is runs/ where you launch from (the launcher makes it absolute there).
    raw = (project / "configs" / "task.toml").read_text().replace('store = "../runs"\n', "")
    (project / "configs" / "unset.toml").write_text(raw)
    assert load_config(project / "configs" / "unset.toml").store == "runs"


def test_code_inside_the_configs_directory_keeps_it_as_the_root(tmp_path: Path) -> None:
    config_path = write_project(tmp_path)
    (tmp_path / "configs" / "mine.py").write_text(
        "def f(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    text = config_path.read_text().replace("../tasks/rewards.py:accuracy", "mine.py:f")
    config_path.write_text(text.replace('paths = ["../tasks/answer_parsing.py"]', "paths = []"))
    config = load_config(config_path)
    assert (config.code.root, config.composer.rewards[0].fn) == (str(tmp_path / "configs"), "mine.py:f")


def test_an_absolute_reward_file_anywhere_is_named_from_the_deepest_common_directory(tmp_path: Path) -> None:
    config_path = write_project(tmp_path / "a" / "proj")
    elsewhere = tmp_path / "b" / "shared"
    elsewhere.mkdir(parents=True)
    (elsewhere / "rewards.py").write_text(REWARDS)
    config_path.write_text(
        config_path.read_text().replace("../tasks/rewards.py", str(elsewhere / "rewards.py"))
    )
    config = load_config(config_path)
    assert config.code.root == str(tmp_path)
    assert config.composer.rewards[0].fn == "b/shared/rewards.py:accuracy"
    assert config.code.paths == ("a/proj/tasks/answer_parsing.py",)


def test_model_path_is_a_directory_when_it_reads_as_one_and_a_hub_id_otherwise(tmp_path: Path) -> None:
    config_path = write_project(tmp_path)
    (tmp_path / "configs" / "my-model").mkdir()
    tiny = config_path.read_text().split("[model.tiny]")[0] + "[model]\npath = 'PLACE'\n"
    rest = config_path.read_text().split("[train]", 1)[1]
    expected = {
        "my-model": str(tmp_path / "configs" / "my-model"),  # a directory next to the config
        "./not-yet": str(tmp_path / "configs" / "not-yet"),
        "../models/a/b": str(tmp_path / "models" / "a" / "b"),
        "~/m": os.path.expanduser("~/m"),
        "Qwen/Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B",  # name or owner/name: a Hub id
        "gpt2": "gpt2",
    }
    for value, path in expected.items():
        config_path.write_text(tiny.replace("PLACE", value) + "[train]" + rest)
        assert load_config(config_path).model.path == path, value


def test_a_resume_override_is_relative_to_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = {"tracking": {"dir": "/old"}, "code": {"root": "/r", "paths": ["a.py"]}}
    apply_override(raw, "tracking.dir=tb")
    apply_override(raw, "diloco.rounds=4")
    assert raw["tracking"]["dir"] == str(tmp_path / "tb")
    assert raw["code"]["paths"] == ["a.py"]  # untouched by an override elsewhere


def test_a_harvest_files_paths_are_relative_to_it(tmp_path: Path, monkeypatch) -> None:
    shipped_file = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "harvest-teachers.toml"
    monkeypatch.chdir(tmp_path)
    harvest = load_harvest_config(shipped_file)
    repo = shipped_file.parents[2]
    assert harvest.traces == str(repo / "deploy" / "data" / "composer-tasks" / "traces.jsonl")
    assert harvest.output == str(repo / "runs" / "harvested" / "pairs.jsonl")
    assert harvest.cache == str(repo / "runs" / "harvest-cache")


def test_a_missing_data_file_names_the_absolute_path_tried_and_the_rule(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = project / "configs" / "task.toml"
    config.write_text(config.read_text().replace('prompts = "train.jsonl"', 'prompts = "trian.jsonl"'))
    assert cli_run(["launch", str(config), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"error: composer.data.prompts: no such file or directory: {project / 'configs' / 'trian.jsonl'}\n"
        "  fix: a relative path in a config file is relative to that file's directory, one given with --set to "
        "the working directory; correct it, or give an absolute path\n"
    )
    assert not (project / "runs").exists()


def test_a_missing_reward_file_names_the_absolute_path_tried(project: Path, capsys) -> None:
    config = project / "configs" / "task.toml"
    config.write_text(config.read_text().replace("../tasks/rewards.py", "../task/rewards.py"))
    assert cli_run(["launch", str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"reward file {project / 'task' / 'rewards.py'} does not exist\n" in err
    assert "fix: name it relative to the config file, or by absolute path" in err


def test_a_missing_trace_file_names_the_absolute_path_tried(project: Path, capsys) -> None:
    teachers = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "harvest-teachers.toml"
    config = project / "configs" / "harvest.toml"
    config.write_text(teachers.read_text().replace("../data/composer-tasks/traces.jsonl", "traces.jsonl"))
    assert cli_run(["harvest", str(config), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: harvest.traces: no such file or directory: {project / 'configs' / 'traces.jsonl'}\n"
        "  fix: a relative path in a config file is relative to that file's directory"
    )


def test_code_outside_the_config_directory_ships_with_its_layout_and_imports_its_neighbours(
    project: Path, tmp_path: Path
) -> None:
    """As an HF Jobs replica gets it: uploaded under code/, fetched (sha256-checked) into a directory of its
    own, the reward imported there with the helper beside it."""
    config = load_config(project / "configs" / "task.toml")
    shipping = shipment.plan(config, cloud=True)
    assert (shipping.root, shipping.code) == (project, ("tasks/answer_parsing.py", "tasks/rewards.py"))
    run = ObjectStore(str(tmp_path / "store")).child("r")
    shipment.upload(run, shipping, code=True)
    fetched = shipped.fetch(run, tmp_path / "replica-code", None)
    assert fetched is not None
    assert sorted(p.relative_to(fetched).as_posix() for p in fetched.rglob("*.py")) == [
        "tasks/answer_parsing.py",
        "tasks/rewards.py",
    ]
    (project / "tasks").rename(project / "moved")  # the replica reads only its own copy
    rewards = RewardSet(config.composer.rewards, fetched)
    record = PromptRecord("1+1=", {"answer": "2"})
    assert rewards.score(["so 2", "3"], [record, record]).totals == [1.0, 0.0]


REPO = Path(__file__).resolve().parents[1]


def _cli_in(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh interpreter started in ``cwd``, with no cloud credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "MODAL_"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(cwd.parent / "home"), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "composer_serverless.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_launched_from_another_directory_local_modal_and_hf_jobs_agree_on_every_path(tmp_path: Path) -> None:
    """configs/ beside tasks/ (the reward and its helper), the data next to the config, the CLI started in a
    third directory with the config's relative path: a local run of one round, and the Modal and HF Jobs
    plans, name the same files."""
    project = tmp_path / "proj"
    write_project(project)
    (tmp_path / "elsewhere").mkdir()
    config = os.path.join("..", "proj", "configs", "task.toml")
    plans = {}
    for executor in ("modal", "hf_jobs"):
        done = _cli_in(
            tmp_path / "elsewhere",
            *("launch", config, "--executor", executor, "--set", "store=s3://bucket/runs", "--dry-run"),
        )
        assert done.returncode == 0, done.stderr
        plans[executor] = json.loads(done.stdout)["resources"]["shipped"]
    done = _cli_in(tmp_path / "elsewhere", "launch", config)
    assert done.returncode == 0, done.stdout + done.stderr
    run = project / "runs" / "paths"  # store = "../runs" in the file: beside configs/
    assert not (tmp_path / "elsewhere" / "runs").exists()
    plans["local"] = json.loads((run / "launch.json").read_text())["plan"]["resources"]["shipped"]
    code = ["tasks/answer_parsing.py", "tasks/rewards.py"]
    data = {
        "composer.data.prompts": [str(project / "configs" / "train.jsonl")],
        "composer.data.heldout": [str(project / "configs" / "data" / "test.jsonl")],
    }
    for executor, plan in plans.items():
        assert (plan["root"], plan["code"]) == (str(project), code), executor
        assert plan["data"] == ({} if executor == "local" else data), executor  # local reads in place
    resolved = json.loads((run / "run.json").read_text())
    assert resolved["code"] == {
        "paths": code[:1],
        "requirements": [],
        "root": str(project),
        "accept_changes": False,
    }
    assert resolved["composer"]["rewards"][0]["fn"] == "tasks/rewards.py:accuracy"
    assert [resolved["composer"]["data"][k] for k in ("prompts", "heldout")] == [v[0] for v in data.values()]
    assert resolved["store"] == str(project / "runs")
    assert json.loads((run / "summary.json").read_text())["rounds_committed"] == 1
    row = json.loads((run / "metrics" / "0" / "000001.json").read_text())  # round 1
    assert "rollout/reward/accuracy" in row["train"]  # the reward in tasks/ ran, with its helper

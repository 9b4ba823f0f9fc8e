"""A user's own RL task, as a TRL user brings it: a reward file next to the config, a dataset with its own
column names, launched from a directory outside the repository with no PYTHONPATH, and everything that is
wrong with them refused before a replica starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from tests.archs import build

MY_TASK = '''
import re

def accuracy(prompts, completions, completion_ids, solution, **kwargs):
    """1 when the completion's last number is the solution: TRL's signature, a column of its own."""
    rewards = []
    for completion, answer in zip(completions, solution):
        text = completion if isinstance(completion, str) else completion[0]["content"]  # conversational
        numbers = re.findall(r"-?\\d+", text)
        rewards.append(float(bool(numbers) and numbers[-1] == str(answer)))
    return rewards

def per_item(completion, record):
    return 1.0

def crashes(prompts, completions, **kwargs):
    return [1.0 / 0 for _ in completions]
'''
# The line the launcher's reward check names when ``crashes`` raises.
CRASHES_LINE = MY_TASK.splitlines().index("    return [1.0 / 0 for _ in completions]") + 1
TINY_MODEL = """[model.tiny]
tokenizer = "chars"
alphabet = " +=0123456789"
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 4"""
CONFIG = """
store = "{store}"

{model}

[train]
objective = "composer"

[diloco]
replicas = 2
sync_every = 2
rounds = 2

[eval]
sequences = 8

[composer.data]
prompts = "{prompts}"
heldout = "{heldout}"

[composer.data.columns]
prompt = "{prompt}"

[[composer.rewards]]
fn = "my_task.py:{fn}"

[composer.rollout]
group_size = 4
prompts_per_step = 2
max_new_tokens = 4

{executor}
"""


def _rows(count: int, seed: int) -> list[dict[str, str]]:
    import random

    rng = random.Random(seed)
    return [
        {"question": f"{a}+{b}=", "solution": str(a + b)}
        for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(count))
    ]


def write_task(
    root: Path,
    fn: str = "accuracy",
    store: str | None = None,
    *,
    prompts: str = "./train.jsonl",
    heldout: str = "./test.jsonl",
    prompt: str = "question",
    model: str = TINY_MODEL,
    executor: str = "[executor]\nthreads_per_replica = 1",
) -> Path:
    """A task directory as a user keeps one: the reward file, the data, the config; returns the config."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_task.py").write_text(MY_TASK)
    for name, rows in (("train.jsonl", _rows(16, 0)), ("test.jsonl", _rows(8, 1))):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "task.toml"
    body = CONFIG.format(
        store=store or "runs",
        model=model,
        prompts=prompts,
        heldout=heldout,
        prompt=prompt,
        fn=fn,
        executor=executor,
    )
    config.write_text(body)
    return config


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it: in ``cwd``, in a fresh interpreter, with no PYTHONPATH."""
    return subprocess.run(
        [sys.executable, "-m", "composer_serverless.cli", *args],
        cwd=cwd,
        env=_without_pythonpath(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _without_pythonpath() -> dict[str, str]:
    """A user's shell: no PYTHONPATH, and no S3 endpoint another test may have pointed at loopback."""
    kept = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AWS_ENDPOINT_URL")}
    return kept | {"COLUMNS": "200"}


@pytest.mark.slow
def test_a_trl_reward_next_to_the_config_trains_from_outside_the_repository(tmp_path: Path) -> None:
    task = tmp_path / "my-task"
    config = write_task(task)
    done = _cli(task, "launch", str(config), "--set", "run_id=own")
    assert done.returncode == 0, done.stdout + done.stderr
    run = task / "runs" / "own"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    rows = [json.loads(p.read_text()) for p in sorted((run / "metrics" / "0").glob("*.json"))]
    assert all("rollout/reward/accuracy" in r["train"] for r in rows if r["round"] > 0)  # its own name
    assert "eval/accuracy" in rows[-1]["eval"]
    resolved = json.loads((run / "run.json").read_text())
    # The reward gives no feedback and the prompts no hints: SDPO stays off; TRL's learning rate.
    assert resolved["composer"]["alpha"] == 0.0 and resolved["train"]["lr"] == 1e-6


@pytest.mark.parametrize("executor", ["modal", "hf_jobs"])
def test_the_dry_run_lists_what_each_cloud_backend_ships(tmp_path: Path, executor: str) -> None:
    config = write_task(tmp_path / "my-task")
    done = _cli(
        tmp_path / "my-task",
        "launch",
        str(config),
        "--executor",
        executor,
        "--set",
        "store=s3://bucket/runs",
        "--set",
        'code.requirements=["math-verify>=0.8"]',
        "--dry-run",
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    shipped = plan["resources"]["shipped"]
    assert shipped["code"] == ["my_task.py"] and shipped["requirements"] == ["math-verify>=0.8"]
    task = tmp_path / "my-task"
    assert shipped["data"] == {
        "composer.data.prompts": [str(task / "train.jsonl")],
        "composer.data.heldout": [str(task / "test.jsonl")],
    }
    assert ("image" if executor == "modal" else "store prefix code/") in shipped["how"]
    if executor == "hf_jobs":  # the job installs the packages before the worker starts
        assert (
            "pip install --quiet --no-cache-dir 'math-verify>=0.8' && exec python"
            in plan["replicas"][0]["command"][-1]
        )


@pytest.mark.parametrize(
    ("fn", "column", "message"),
    [
        ("per_item", "question", "cannot be called as rewards are"),
        (
            "crashes",
            "question",
            f"raised ZeroDivisionError: float division by zero at my_task.py:{CRASHES_LINE}",
        ),
        ("accuracy", "query", "column 'query' (mapped to 'prompt' by composer.data.columns) is not in"),
    ],
    ids=["wrong signature", "raises on the first records", "mapped column missing"],
)
def test_a_task_that_cannot_train_exits_2_before_anything_is_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fn: str,
    column: str,
    message: str,
) -> None:
    config = write_task(tmp_path, fn=fn, store=str(tmp_path / "store"), prompt=column)
    monkeypatch.chdir(tmp_path)
    assert cli_run(["launch", str(config), "--set", "run_id=own"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "store").exists()  # nothing written, so nothing started


@pytest.mark.parametrize(
    ("missing", "data", "install"),
    [
        ("pyarrow", "train.parquet", "pip install 'composer-serverless[parquet]'"),
        ("datasets", "dataset", "pip install 'composer-serverless[hf]'"),
    ],
)
def test_a_missing_reader_exits_2_with_its_install_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    missing: str,
    data: str,
    install: str,
) -> None:
    config = write_task(tmp_path, store=str(tmp_path / "store"))
    (tmp_path / data).mkdir() if data == "dataset" else (tmp_path / data).write_bytes(b"PAR1")
    config.write_text(
        config.read_text().replace('prompts = "./train.jsonl"', f'prompts = "{tmp_path / data}"')
    )
    for module in (missing, f"{missing}.parquet"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    monkeypatch.chdir(tmp_path)
    assert cli_run(["launch", str(config), "--dry-run"]) == 2
    assert install in capsys.readouterr().err


@pytest.mark.slow
def test_conversations_with_a_system_turn_from_a_hub_style_dataset_and_parquet_train(
    tmp_path: Path, chat_model_dir: Path
) -> None:
    """Prompts as a conversational column read through ``datasets`` from a dataset directory (as
    ``load_dataset``/``save_to_disk`` leave it), held-out prompts from Parquet: the run trains on both."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    system = {"role": "system", "content": "Answer with the number only."}

    def conversation(row: dict[str, str]) -> dict:
        return {
            "messages": [system, {"role": "user", "content": row["question"]}],
            "solution": row["solution"],
        }

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([conversation(r) for r in _rows(16, 0)])}
    ).save_to_disk(tmp_path / "dataset")
    pq.write_table(pa.Table.from_pylist([conversation(r) for r in _rows(8, 1)]), tmp_path / "test.parquet")
    config = write_task(
        tmp_path,
        prompts=str(tmp_path / "dataset"),
        heldout=str(tmp_path / "test.parquet"),
        prompt="messages",
        model=f'[model]\npath = "{chat_model_dir}"',
    )
    done = _cli(tmp_path, "launch", str(config), "--set", "run_id=chat")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "runs" / "chat" / "summary.json").read_text())
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]


def test_a_local_run_needs_its_requirements_installed_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_task(tmp_path, store=str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert (
        cli_run(
            ["launch", str(config), "--set", 'code.requirements=["no-such-package-here>=1"]', "--dry-run"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "requirement 'no-such-package-here>=1' is not installed in this environment" in err
    assert "fix: pip install 'no-such-package-here>=1'" in err


RECIPE = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "gsm8k-qwen2.5-0.5b.toml"


@pytest.mark.slow
def test_the_math_recipe_runs_end_to_end_with_a_tiny_qwen2(tmp_path: Path, chat_model_dir: Path) -> None:
    model = build("qwen2", chat_model_dir, tmp_path / "qwen2")  # a Qwen2 with the chat tokenizer
    sets = {
        "model.path": model,
        "store": tmp_path / "runs",
        "run_id": "gsm8k",
        "diloco.replicas": 2,
        "diloco.sync_every": 2,
        "diloco.rounds": 2,
        "eval.sequences": 8,
        "composer.rollout.group_size": 4,
        "composer.rollout.prompts_per_step": 2,
        "composer.rollout.max_new_tokens": 8,
        "executor.threads_per_replica": 1,
    }
    argv = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    done = _cli(RECIPE.parents[2], "launch", str(RECIPE), *argv)
    assert done.returncode == 0, done.stdout + done.stderr
    run = tmp_path / "runs" / "gsm8k"
    assert json.loads((run / "summary.json").read_text())["rounds_committed"] == 2
    resolved = json.loads((run / "run.json").read_text())
    assert resolved["composer"]["alpha"] == 1.0  # the correct reward gives feedback: SDPO is on
    row = json.loads((run / "metrics" / "0" / "000002.json").read_text())
    assert {"rollout/reward/correct", "rollout/reward/formatted", "sdpo/loss"} <= row["train"].keys()


@pytest.mark.parametrize("executor", ["modal", "hf_jobs"])
def test_the_math_recipe_plans_on_each_cloud_backend_from_any_directory(
    executor: str, tmp_path: Path
) -> None:
    """Its paths are relative to the recipe's file, so the working directory does not matter."""
    done = _cli(
        tmp_path,
        "launch",
        str(RECIPE),
        "--executor",
        executor,
        "--set",
        "store=s3://bucket/runs",
        "--dry-run",
    )
    assert done.returncode == 0, done.stderr
    shipped = json.loads(done.stdout)["resources"]["shipped"]
    assert shipped["root"] == str(RECIPE.parent) and shipped["code"] == ["gsm8k_reward.py"]
    sample = RECIPE.parents[1] / "data" / "gsm8k-sample"
    assert shipped["data"] == {
        "composer.data.prompts": [str(sample / "train.jsonl")],
        "composer.data.heldout": [str(sample / "test.jsonl")],
    }

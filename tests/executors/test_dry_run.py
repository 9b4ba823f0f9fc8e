"""``launch --dry-run`` prints the plan and its cost for every backend without any network at all: the CLI
runs in a network namespace with no interfaces (``unshare -n``), with no credentials, and still exits 0.

It checks the model as the launch does (a Hub model from the cache only, or said to be unchecked), prints the
resolved settings, warns of a model past the GPU named or large on a CPU, estimates the cost from a measured
step time when the project has one for that GPU, and ``sweep --dry-run`` does all of it for every cell."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from composer_serverless.accelerator import ACCELERATOR_ENV
from composer_serverless.executors.runtime import TORCH_VERSION
from tests.executors.conftest import REPO

EXECUTORS = {
    "local": [],
    "modal": ["--set", "store=s3://your-bucket/runs", "--set", "executor.seconds_per_step=0.05"],
    "hf_jobs": ["--set", "store=s3://your-bucket/runs", "--set", "executor.seconds_per_step=0.05"],
}


def _offline_prefix() -> list[str]:
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode
    ):
        pytest.skip("cannot create a network namespace here (needs unshare and the privilege to use it)")
    return ["unshare", "-n"]


@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_dry_run_prints_plan_and_cost_without_network(executor, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "MODAL_"))}
    env.update(HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO), COLUMNS="200")
    config = REPO / "deploy" / "configs" / "local-demo.toml"
    args = [
        "launch",
        str(config),
        "--executor",
        executor,
        "--set",
        "run_id=dry",
        *EXECUTORS[executor],
        "--dry-run",
    ]
    result = subprocess.run(
        [*_offline_prefix(), sys.executable, "-m", "composer_serverless.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["executor"] == executor and len(plan["replicas"]) == 4 and plan["run_id"] == "dry"
    assert "estimated cost:" in result.stderr
    # The plan says what the replicas load, and that no checkpoint code will run without consent.
    assert plan["model"]["trust_remote_code"] is False and plan["model"]["dtype"] == "float32"
    if executor == "local":
        assert plan["cost"]["max_usd"] == 0 and "$0 (local processes" in result.stderr
        return
    # 4 replicas x 3 attempts x 6 h at the list price; expected: 4 x (300 s + 36 x 10 x 0.05 s).
    price = {"modal": 3.95, "hf_jobs": 2.50}[executor]
    assert plan["cost"]["max_usd"] == round(4 * 3 * 6 * price, 2)
    assert plan["cost"]["expected_usd"] == round(4 * (300 + 36 * 10 * 0.05) / 3600 * price, 2)
    # The torch build the replicas will run, for which driver; and that they must find their GPUs.
    build = plan["resources"]["image"] if executor == "modal" else plan["resources"]["torch"]
    assert build["torch"] == f"{TORCH_VERSION}+cu128" and build["nvidia_driver"] == ">= 570.26"
    assert all(r["env"][ACCELERATOR_ENV] == "cuda" for r in plan["replicas"])
    assert "launch would stop here until these are fixed" in result.stderr  # no credentials in this shell
    assert "AWS_SECRET_ACCESS_KEY is not set" in result.stderr


# Qwen2.5-1.5B's published shape (its config.json); tied embedding: 151936 x 1536 + 28 layers x 46,797,824 +
# 1536 for the final norm.
QWEN_15B_SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN_15B = 1_543_714_304


@pytest.fixture(scope="module")
def qwen_15b_shape(tmp_path_factory, tiny_model_dir) -> Path:
    """A checkpoint directory as the model check reads it (config and tokenizer) at Qwen2.5-1.5B's shape,
    without weights: the check builds the model on the meta device and never loads them."""
    from transformers import AutoTokenizer, Qwen2Config

    out = tmp_path_factory.mktemp("qwen-1.5b-shape")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    Qwen2Config(**QWEN_15B_SHAPE, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# The shape as a Hub repository in a Hugging Face cache: what cloud replicas load (they cannot read a directory
# of this machine), and what a dry run, offline, can check only from the cache.
HUB_ID = "tester/qwen-1.5b-shape"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, qwen_15b_shape: Path) -> Path:
    """An ``HF_HOME`` whose cache holds ``HUB_ID`` at one snapshot, laid out as huggingface_hub keeps it."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(qwen_15b_shape, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return home


def _dry_run(tmp_path: Path, *args: str, hf_home: Path | None = None) -> tuple[int, str, str]:
    """``args`` through the CLI in this process (``--dry-run`` added), with no GPU visible (and the model
    checks' child processes given ``hf_home``)."""
    from typer.testing import CliRunner

    from composer_serverless.cli import app

    env = {"CUDA_VISIBLE_DEVICES": "", "COLUMNS": "300", "HF_HOME": str(hf_home or tmp_path / "hf")}
    result = CliRunner().invoke(app, [*args, "--dry-run"], env=env)
    return result.exit_code, result.stdout, result.stderr


MODAL = ("--executor", "modal", "--set", "store=s3://bucket/runs")


def _config(tmp_path: Path, model: Path | str) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(
        f'store = "{tmp_path / "store"}"\n[model]\npath = "{model}"\ndtype = "bfloat16"\n'
        "[diloco]\nreplicas = 4\nsync_every = 10\nrounds = 30\n"
    )
    return config


@pytest.mark.slow
def test_a_model_too_large_for_the_gpu_named_is_warned_about(tmp_path: Path, hf_home: Path) -> None:
    config = _config(tmp_path, HUB_ID)
    code, out, err = _dry_run(
        tmp_path, "launch", str(config), *MODAL, "--set", "executor.gpu=T4", hf_home=hf_home
    )
    assert code == 0, err
    assert json.loads(out)["executor"] == "modal"
    assert "settings: objective lm, lr 0.003, devices 1 x T4 (16 GB) per replica\n" in err
    # 1,543,714,304 x (4 master + 4 gradient + 8 AdamW) bytes = 24.70 GB, above a T4's 16 GB.
    assert (
        f"model: checked (config, tokenizer, a meta-device instance): {QWEN_15B:,} parameters (all trained), "
        "24.70 GB of weights, gradients and optimizer state per replica before activations\n"
    ) in err
    assert (
        "warning: the model has 1,544M parameters: its weights, gradients and optimizer state take 24.7 GB"
        in err
    )
    code, _, err = _dry_run(
        tmp_path, "launch", str(config), *MODAL, "--set", "executor.gpu=L40S", hf_home=hf_home
    )
    assert code == 0 and "warning" not in err, err


@pytest.mark.slow
def test_a_large_model_on_the_cpu_is_said(tmp_path: Path, qwen_15b_shape: Path) -> None:
    code, _, err = _dry_run(tmp_path, "launch", str(_config(tmp_path, qwen_15b_shape)))
    assert code == 0, err
    assert "settings: objective lm, lr 0.003, devices cpu\n" in err
    assert "warning: the replicas train on the CPU (devices: cpu) and the model has 1,544M parameters" in err
    assert err.endswith("this machine has what the launch needs; left for the launch: the store\n")


def test_the_expected_cost_comes_from_a_measured_step_time_on_that_gpu(
    tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from composer_serverless.config import load_config
    from composer_serverless.executors import measured

    config = _config(tmp_path, HUB_ID)
    args = ["launch", str(config), *MODAL]
    results = tmp_path / "gpu"
    results.mkdir()
    monkeypatch.setattr(measured, "RESULTS_DIR", results)
    code, _, err = _dry_run(tmp_path, *args, hf_home=hf_home)
    assert code == 0 and "expected: no step time measured for this GPU, model size and workload" in err, err
    line = {
        "exit_code": 0,
        "step_s": {"generate": 0.0, "forward_backward": 0.25, "optimizer": 0.125, "sync": 0.125},
        "params": {"total": 1_500_000_000},  # within 10 % of 1,543,714,304
        "workload": measured.workload(load_config(config, [], "modal")),
    }
    doc = {"device": "NVIDIA H100 80GB HBM3", "cuda": True, "date": "2026-11-20", "commit": "abc1234"}
    (results / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps({**doc, "lines": [line]}))
    code, out, err = _dry_run(tmp_path, *args, hf_home=hf_home)
    assert code == 0, err
    # Per replica 300 s + 30 rounds x 10 steps x 0.5 s = 450 s; 4 replicas 0.5 h at $3.95: $1.98 (0.50 h).
    assert json.loads(out)["cost"]["expected_usd"] == 1.98
    assert (
        "estimated cost: expected $1.98 (0.50 replica-hours; 30 rounds x 10 steps x 0.5 s/step + 300 s start-up "
        "per replica, measured on NVIDIA H100 80GB HBM3, 2026-11-20, commit abc1234); at most $284.40 "
    ) in err


def test_a_hub_model_offline_is_said_to_be_unchecked_with_the_resolved_settings(tmp_path: Path) -> None:
    """The issue's example: the GSM8K recipe's dry run, with no network and an empty Hugging Face cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "MODAL_"))}
    env.update(
        HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES=""
    )
    config = REPO / "deploy" / "configs" / "gsm8k-qwen2.5-0.5b.toml"
    result = subprocess.run(
        [
            *_offline_prefix(),
            sys.executable,
            "-m",
            "composer_serverless.cli",
            "launch",
            str(config),
            "--dry-run",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == (
        "settings: objective composer, lr 1e-06, alpha 1.0 (auto), beta 0.0, engine reference (auto: on the CPU), "
        "devices cpu"
    )
    assert lines[1].startswith(
        "model: not checked: model.path 'Qwen/Qwen2.5-0.5B-Instruct' is not a directory here, so it names a Hub "
        "repository, and that is not in this machine's Hugging Face cache; a dry run reaches no network"
    )
    assert (
        lines[-1]
        == "this machine has what the launch needs; left for the launch: the store, the model (see above)"
    )


def test_a_sweep_dry_run_checks_and_plans_every_cell_and_writes_nothing(tmp_path: Path) -> None:
    config = REPO / "deploy" / "configs" / "local-demo.toml"
    store = tmp_path / "store"
    args = [
        "sweep",
        str(config),
        "--grid",
        "train.lr=0.001,0.002",
        "--set",
        f"store={store}",
        "--set",
        "run_id=g",
    ]
    code, out, err = _dry_run(tmp_path, *args)
    assert code == 0, err
    plans = json.loads(out)
    assert [p["run_id"] for p in plans] == ["g-c0", "g-c1"]
    assert "cell 0 (train.lr=0.001):\n  settings: objective lm, lr 0.001, devices cpu\n" in err
    assert "cell 1 (train.lr=0.002):\n  settings: objective lm, lr 0.002, devices cpu\n" in err
    assert err.endswith("this machine has what the sweep needs; left for the launch: the store\n")
    assert not store.exists()

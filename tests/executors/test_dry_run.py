"""``launch --dry-run`` prints the plan and its cost for every backend without any network at all: the CLI
runs in a network namespace with no interfaces (``unshare -n``), with no credentials, and still exits 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

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

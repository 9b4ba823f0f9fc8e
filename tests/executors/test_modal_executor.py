"""Modal without a Modal account: the plan (no network), the replica function's body through Modal's
own ``.local()``, the launcher driving ``ModalExecutor`` through a fake of its server seam, and
``modal run --help``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from rich.console import Console

from composer_serverless import runs
from composer_serverless.config import validate_config
from composer_serverless.executors import modal as modal_executor
from composer_serverless.executors.base import LaunchPlan, worker_argv
from composer_serverless.executors.modal import ModalExecutor
from composer_serverless.executors.modal_image import IMAGE_REQUIREMENTS
from composer_serverless.launcher import create_run, launch, prepare, start
from composer_serverless.rendezvous.telemetry import read_heartbeats
from tests.conftest import TINY
from tests.executors.fake_modal import FakeModalCalls

REPO = Path(__file__).resolve().parents[2]


def _config(store: str, replicas: int = 2, rounds: int = 2, **executor):
    return validate_config(
        {
            "run_id": executor.pop("run_id", "modal-run"),
            "store": store,
            "model": {"tiny": TINY.model_dump()},
            "data": {"seq_len": 32, "batch_size": 4},
            "diloco": {"replicas": replicas, "sync_every": 3, "rounds": rounds},
            "eval": {"sequences": 8},
            "executor": {"type": "modal", **executor},
        }
    )


@pytest.fixture
def fake_modal(tmp_path, monkeypatch):
    FakeModalCalls.reset(tmp_path)
    monkeypatch.setattr(modal_executor, "ModalSDKCalls", FakeModalCalls)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")  # a user who ran `modal token new`
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    yield FakeModalCalls
    FakeModalCalls.kill_all()


def test_plan_without_network(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-printed")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://s3.example.com")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    config = _config(
        "s3://bucket/runs",
        replicas=4,
        rounds=10,
        gpu="a100-80gb",
        gpu_count=2,
        timeout_s=7200,
        max_restarts=3,
        seconds_per_step=0.5,
    )
    plan = ModalExecutor().plan(config, "s3://bucket/runs/modal-run")
    res = plan.resources
    assert res["gpu"] == "A100-80GB:2" and res["timeout_s"] == 7200 and res["retries"] == 3
    assert res["max_containers"] is None and res["detached"] is True and res["single_use_containers"] is True
    assert res["image"] == {"python": "3.11", "requirements": list(IMAGE_REQUIREMENTS)}
    assert plan.launcher_restarts == 0  # Modal's retries restart replicas, not the launcher
    assert [s.rank for s in plan.replicas] == [0, 1, 2, 3]
    spec = plan.replicas[1]
    assert spec.command == worker_argv("s3://bucket/runs/modal-run", 1)
    assert spec.secrets == ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    assert spec.env["AWS_ENDPOINT_URL_S3"] == "https://s3.example.com"
    # $2.50/GPU-hour x 2 GPUs; at most 4 replicas x (1 + 3 restarts) x 2 h;
    # expected 4 x (300 s + 10 x 3 x 0.5 s).
    assert plan.cost.price_per_replica_hour == 5.0 and plan.cost.gpus_per_replica == 2
    assert plan.cost.max_usd == 4 * 4 * 2 * 5.0
    assert plan.cost.expected_usd == round(4 * (300 + 10 * 3 * 0.5) / 3600 * 5.0, 2)
    assert LaunchPlan.from_dict(json.loads(plan.to_json())) == plan
    assert "not-printed" not in plan.to_json()


def test_image_installs_what_pyproject_declares():
    """The image cannot read pyproject.toml in a container, so it lists the requirements: keep them equal."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [r for r in project["dependencies"] if "python_version" not in r]
    declared += project["optional-dependencies"]["s3"] + project["optional-dependencies"]["hf"]

    def name(requirement: str) -> str:
        return (
            requirement.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
        )

    assert sorted(map(name, IMAGE_REQUIREMENTS)) == sorted(set(map(name, declared)))
    pinned = (REPO / "Makefile").read_text().split("pip install --quiet torch==")[1].split()[0]
    assert f"torch=={pinned}" in IMAGE_REQUIREMENTS


def test_replica_function_body_runs_through_modal_local(tmp_path):
    from composer_serverless.executors.modal_app import train_replica

    config = _config(str(tmp_path / "store"), replicas=1)
    run, _ = create_run(config, "modal-local.toml", Console(file=io.StringIO()))
    assert train_replica.local(run.url, 0) == 0
    assert read_heartbeats(run)[0]["state"] == "done"
    assert run.exists("final/config.json")


@pytest.mark.slow
def test_launcher_drives_modal_through_the_seam(tmp_path, s3_store, fake_modal):
    store, _ = s3_store
    out = io.StringIO()
    summary = launch(_config(store, status_poll_s=0.5), "modal.toml", Console(file=out, width=120))
    assert summary is not None and summary["rounds_committed"] == 2, out.getvalue()

    (request,) = fake_modal.spawned
    assert request.ranks == (0, 1) and request.gpu == "H100" and request.timeout_s == 6 * 3600
    assert request.retries == 2 and request.run_url == f"{store}/modal-run"
    assert request.secret_env == ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    assert request.env["AWS_ENDPOINT_URL_S3"] == os.environ["AWS_ENDPOINT_URL_S3"]
    assert set(fake_modal.polled) == set(fake_modal.procs)

    # Another process: a fresh executor finds the calls through launch.json alone.
    opened, rows = runs.status(f"{store}/modal-run")
    assert [r.state for r in rows] == ["succeeded", "succeeded"]
    assert {r.backend_id for r in rows} == set(fake_modal.procs)
    assert all(h.meta == {"app_id": "ap-fake"} for h in opened.record.handles)
    assert any("[replica 1]" in line for line in runs.logs(f"{store}/modal-run", 1, follow=False))


@pytest.mark.slow
def test_cancel_from_another_process_through_the_seam(tmp_path, s3_store, fake_modal):
    store, _ = s3_store
    start(
        prepare(_config(store, rounds=500, run_id="modal-cancel"), "modal.toml"), Console(file=io.StringIO())
    )
    statuses = runs.cancel(f"{store}/modal-cancel")
    assert sorted(fake_modal.cancelled) == sorted(fake_modal.procs)
    assert [s.state for s in statuses] == ["cancelled", "cancelled"]
    assert all(proc.poll() is not None for proc in fake_modal.procs.values())


@pytest.mark.parametrize(
    ("ref", "options"), [("", ["--config", "--replicas", "--set", "--dry-run"]), ("::sweep", ["--grid"])]
)
def test_modal_run_help_works_offline(tmp_path, ref, options):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    modal_cli = Path(sys.executable).parent / "modal"
    result = subprocess.run(
        [str(modal_cli), "run", f"deploy/modal_app.py{ref}", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(option in result.stdout for option in ["--config", *options])

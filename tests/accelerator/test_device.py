"""A replica computes on the GPU it was given or stops and says why; executors say when they gave one; the RNG
state a replica saves is its own device's."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from composer_serverless.accelerator import ACCELERATOR_ENV
from composer_serverless.accelerator.device import (
    NoAcceleratorError,
    replica_device,
    restore_rng_state,
    rng_state,
)
from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import validate_config
from composer_serverless.executors import local
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from composer_serverless.executors.local import LocalProcessExecutor
from composer_serverless.launch.launcher import create_run
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

REPO = Path(__file__).resolve().parents[2]


def test_without_a_gpu_a_replica_computes_on_the_cpu_unless_it_was_given_one() -> None:
    assert replica_device(0, {}) == torch.device("cpu")
    with pytest.raises(NoAcceleratorError) as raised:
        replica_device(0, {ACCELERATOR_ENV: "cuda"})
    message = str(raised.value)
    assert f"{ACCELERATOR_ENV}=cuda" in message and "CPU-only build" in message and "Fix:" in message


def test_with_a_gpu_each_local_rank_takes_its_own() -> None:
    with simulated():
        assert replica_device(1, {ACCELERATOR_ENV: "cuda"}) == torch.device("cuda", 1)
        assert replica_device(0, {}) == torch.device("cuda", 0)


def _config(tmp_path: Path, store: str | None = None, **executor: object) -> object:
    return validate_config(
        {
            "run_id": "gpu",
            "store": store or str(tmp_path),
            "model": {"tiny": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 1},
            "executor": executor or {"type": "local"},
        }
    )


def test_executors_say_when_they_gave_a_replica_gpus(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(local, "visible_gpus", lambda: [])
    plan = LocalProcessExecutor(ObjectStore(str(tmp_path / "gpu")), tmp_path / "logs").plan(
        _config(tmp_path), str(tmp_path / "gpu")
    )
    assert all(ACCELERATOR_ENV not in r.env for r in plan.replicas)
    monkeypatch.setattr(local, "visible_gpus", lambda: ["0", "1"])
    plan = LocalProcessExecutor(ObjectStore(str(tmp_path / "gpu")), tmp_path / "logs").plan(
        _config(tmp_path), str(tmp_path / "gpu")
    )
    assert [(r.env["CUDA_VISIBLE_DEVICES"], r.env[ACCELERATOR_ENV]) for r in plan.replicas] == [
        ("0", "cuda"),
        ("1", "cuda"),
    ]
    for flavor, given in (("cpu-upgrade", False), ("l4x1", True)):
        config = _config(tmp_path, "s3://b/r", type="hf_jobs", flavor=flavor, private_store_endpoint=True)
        plan = HFJobsExecutor().plan(config, "s3://b/r/gpu")
        assert all((ACCELERATOR_ENV in r.env) is given for r in plan.replicas), flavor


@pytest.mark.slow
def test_a_replica_given_gpus_that_finds_none_exits_non_zero_and_says_why(tmp_path: Path) -> None:
    run, _ = create_run(_config(tmp_path), "gpu.toml", Console(quiet=True))
    result = subprocess.run(
        [sys.executable, "-m", "composer_serverless.replicas.worker", "--run", run.url, "--rank", "0"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), ACCELERATOR_ENV: "cuda"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "NoAcceleratorError: this replica was given GPUs" in result.stderr
    beat = json.loads(run.get(layout.heartbeat(0)))
    assert beat["state"] == "failed" and "given GPUs" in beat["error"]
    assert not run.exists(layout.INITIAL_WEIGHTS)  # stopped before it trained or agreed on anything


def test_the_rng_state_saved_is_this_device_s_and_another_device_type_is_said(caplog) -> None:
    assert rng_state(torch.device("cpu")) == {}
    with simulated():
        saved = rng_state(torch.device("cuda", 3))
        assert saved["device"]["type"] == "cuda"
        torch.cuda.set_rng_state(torch.ones(16, dtype=torch.uint8), "cuda:3")
        restore_rng_state(saved, torch.device("cuda", 3))
        assert torch.equal(torch.cuda.get_rng_state("cuda:3"), saved["device"]["state"])
    with caplog.at_level(logging.WARNING):
        restore_rng_state(saved, torch.device("cpu"))
    assert "cuda run and this replica runs on the CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        restore_rng_state({}, torch.device("cpu"))
    assert caplog.text == ""

"""A replica whose training diverges stops with a message that says so and how to fix it, and the run never
reports success: one NaN averaged in would otherwise turn every parameter of every replica into NaN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.launcher import create_run
from composer_serverless.objectives import lm as objective
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.replicas.trainer import DivergedError, run_replica


def test_a_non_finite_loss_stops_the_replica_with_the_fix(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    config = validate_config(
        {
            "run_id": "diverges",
            "store": str(tmp_path),
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 0.5},
            "diloco": {"replicas": 1, "sync_every": 2, "rounds": 3},
            "eval": {"sequences": 2},
        }
    )
    run, _ = create_run(config, "test", Console(quiet=True))
    real_losses = objective.LMObjective.losses
    steps = 0

    def diverging(self, model):
        nonlocal steps
        steps += 1
        for loss, metrics in real_losses(self, model):
            yield (loss * float("nan") if steps == 3 else loss), metrics

    monkeypatch.setattr(objective.LMObjective, "losses", diverging)
    with pytest.raises(
        DivergedError, match=r"training loss is nan in round 2, step 1: training diverged"
    ) as e:
        run_replica(ObjectStore(run.url), 0)
    assert "Lower train.lr (now 0.5)" in str(e.value)
    beat = read_heartbeats(run)[0]
    assert beat["state"] == "failed" and "DivergedError" in beat["error"]
    assert torch.isfinite(torch.tensor(beat.get("loss", 0.0)))  # the last loss it reported was a number

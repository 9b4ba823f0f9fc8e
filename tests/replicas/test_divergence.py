"""A step whose loss is not finite is discarded and the replica goes on from the global parameters of its last
sync; a replica whose loss keeps being non-finite stops with a message that says so and how to fix it, and
the run never reports success: one NaN averaged in would otherwise turn every parameter of every replica into
NaN."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import validate_config
from composer_serverless.launch.launcher import create_run
from composer_serverless.objectives import lm as objective
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics
from composer_serverless.replicas import trainer
from composer_serverless.replicas.diloco import global_parameters
from composer_serverless.replicas.trainer import MAX_NONFINITE_STEPS, DivergedError, run_replica


def _run(tmp_path: Path, model_dir: Path) -> ObjectStore:
    config = validate_config(
        {
            "run_id": "diverges",
            "store": str(tmp_path),
            "model": {"path": str(model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 0.5},
            "diloco": {"replicas": 1, "sync_every": 2, "rounds": 3},
            "eval": {"sequences": 2},
        }
    )
    run, _ = create_run(config, "test", Console(quiet=True))
    return run


def _nan_at(monkeypatch, poisoned: Callable[[int], bool]) -> None:
    """The objective's loss times NaN at every call ``poisoned(call)`` holds for (calls count from 1)."""
    real_losses = objective.LMObjective.losses
    calls = 0

    def diverging(self, model):
        nonlocal calls
        calls += 1
        for loss, metrics in real_losses(self, model):
            yield (loss * float("nan") if poisoned(calls) else loss), metrics

    monkeypatch.setattr(objective.LMObjective, "losses", diverging)


def test_a_non_finite_loss_once_is_discarded_and_the_run_completes(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch, caplog
) -> None:
    """The third step's loss is NaN: it is discarded (the round still runs its 2 steps, on later batches),
    the parameters go back to the global ones of the last sync, and all 3 rounds complete with a finite
    model; on the simulated accelerator (the restore copies host memory DiLoCo fills asynchronously onto the
    device) it ends bit for bit where the CPU run does."""
    finals = {}
    for place in ("cpu", "accelerator"):
        run = _run(tmp_path / place, tiny_model_dir)
        _nan_at(monkeypatch, lambda call: call == 3)
        with simulated() if place == "accelerator" else contextlib.nullcontext():
            run_replica(ObjectStore(run.url), 0)
        rows = read_metrics(run)[0]
        assert [row["round"] for row in rows if "train_loss" in row] == [1, 2, 3]
        assert all(row["steps"] == 2 for row in rows if "train_loss" in row)
        # Peak device memory is counted on the (simulated) accelerator only: the run really was there.
        trained = [row for row in rows if "train_loss" in row]
        assert all((row["device_peak_bytes"] or 0) > 0 for row in trained) == (place == "accelerator")
        assert read_heartbeats(run)[0]["state"] == "done"
        finals[place] = load_file(run.local_dir(layout.FINAL) / "model.safetensors")
        assert all(bool(torch.isfinite(t).all()) for t in finals[place].values())
    assert caplog.text.count("the training loss is nan in round 2, step 1: step discarded") == 2
    assert finals["cpu"].keys() == finals["accelerator"].keys()
    assert all(torch.equal(finals["cpu"][k], finals["accelerator"][k]) for k in finals["cpu"])


def test_a_loss_that_stays_non_finite_stops_the_replica_with_the_fix(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    run = _run(tmp_path, tiny_model_dir)
    _nan_at(monkeypatch, lambda call: call >= 3)
    with pytest.raises(
        DivergedError,
        match=rf"training loss is nan in round 2, step 1 \({MAX_NONFINITE_STEPS} non-finite losses since the "
        r"last committed round\): training diverged",
    ) as e:
        run_replica(ObjectStore(run.url), 0)
    assert "Lower train.lr (now 0.5)" in str(e.value)
    beat = read_heartbeats(run)[0]
    assert beat["state"] == "failed" and "DivergedError" in beat["error"]
    assert torch.isfinite(torch.tensor(beat.get("loss", 0.0)))  # the last loss it reported was a number


def test_with_error_reset_a_discarded_step_keeps_the_residual_in_the_local_weights(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    """With the sparse codec and error reset the last sync left the local weights at the global ones minus the
    replica's residual: a discarded step (round 2's first) puts them back there, not at the global ones, which
    would drop what the replica had not sent yet."""
    config = validate_config(
        {
            "run_id": "reset",
            "store": str(tmp_path),
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 0.05},
            "diloco": {
                "replicas": 1,
                "sync_every": 2,
                "rounds": 2,
                "codec": "sparse",
                "error_feedback": "reset",
            },
            "eval": {"sequences": 2},
        }
    )
    run, _ = create_run(config, "test", Console(quiet=True))
    _nan_at(monkeypatch, lambda call: call == 3)
    real = trainer.Replica._discard_step
    checked: list[bool] = []

    def discard_and_check(self, value: float) -> None:
        real(self, value)
        params = global_parameters(self.manager, self.names)
        model = dict(self.model.named_parameters())
        for index, names in enumerate(self.names):
            residual = self.manager.feedback.residuals[index].inputs
            assert bool(residual.abs().sum() > 0)
            offset = 0
            for name in names.values():
                size = params[name].numel()
                expected = params[name].reshape(-1) - residual[offset : offset + size]
                checked.append(torch.equal(model[name].detach().cpu().reshape(-1), expected))
                offset += size

    monkeypatch.setattr(trainer.Replica, "_discard_step", discard_and_check)
    with simulated():
        run_replica(ObjectStore(run.url), 0)
    assert checked and all(checked), checked

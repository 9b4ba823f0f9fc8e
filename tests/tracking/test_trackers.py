"""Each tracker through its own client, reopened as a later relay reopens it; a tracker that is not installed is
told before the run starts, with the fix, and nothing is written."""

from __future__ import annotations

import importlib.util
import io

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless import launcher
from composer_serverless.config import ConfigError, validate_config
from composer_serverless.config.outputs import TrackingConfig
from composer_serverless.tracking import trackers
from tests.conftest import TINY


def test_a_reopened_tensorboard_run_goes_on_in_the_same_directory(tmp_path) -> None:
    tracking = TrackingConfig(report_to=("tensorboard",))
    for steps in ([1, 2], [3]):  # the launcher, then `status` after a detach
        tracker = trackers.open_tracker("tensorboard", tracking, "run", {"seed": 0}, tmp_path)
        for step in steps:
            tracker.log(step, {"train/loss": 1.0 / step})
        tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, 0.3333),
    ]


def test_trackers_not_installed_are_named_with_the_fix(monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name)
    )
    assert trackers.missing(TrackingConfig(report_to=("tensorboard",))) == []
    (problem,) = trackers.missing(TrackingConfig(report_to=("tensorboard", "wandb")))
    assert problem.startswith("tracking.report_to names wandb, not installed here")
    assert "pip install 'composer-serverless[tracking]'" in problem


def test_a_launch_whose_tracker_is_not_installed_stops_before_the_store_is_written(
    tmp_path, monkeypatch
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "trackio" else find_spec(name)
    )
    config = validate_config(
        {
            "run_id": "untracked",
            "store": str(tmp_path / "store"),
            "model": {"tiny": TINY.model_dump()},
            "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1},
            "tracking": {"report_to": ["trackio"]},
        }
    )
    prepared = launcher.prepare(config, "untracked.toml")
    with pytest.raises(ConfigError, match="tracking.report_to names trackio, not installed here"):
        launcher.start(prepared, Console(file=io.StringIO()))
    assert not (tmp_path / "store" / "untracked").exists()

"""Each tracker through its own client, reopened as a later relay reopens it; a tracker that is not installed is
told before the run starts, with the fix, and nothing is written."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer import event_file_writer

from composer_serverless.config import ConfigError, load_config, validate_config
from composer_serverless.config.outputs import TrackingConfig
from composer_serverless.launch import launcher
from composer_serverless.tracking import trackers
from tests.conftest import TINY

MINIMAL = {"model": {"tiny": {}}, "diloco": {"sync_every": 4, "rounds": 2}}


def test_a_reopened_tensorboard_run_goes_on_in_the_same_directory(tmp_path, monkeypatch) -> None:
    """Its steps are read in order whatever the writers' names: here the process's writer counter goes from 9
    to 10, which sorts as text before it (CI's failure once a process had opened nine)."""
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
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


@pytest.mark.parametrize(
    ("given", "chosen"),
    [
        ("wandb", ("wandb",)),
        (["tensorboard", "wandb"], ("tensorboard", "wandb")),
        ("none", ()),
        (["none"], ()),
        ("all", ("tensorboard", "wandb")),
        (["all"], ("tensorboard", "wandb")),
    ],
)
def test_report_to_takes_what_trl_takes(monkeypatch, caplog, tmp_path, given, chosen) -> None:
    """A string, a list, "none", or "all": every tracker whose client is installed (trackio hidden here), said
    in the log; run.json holds the trackers chosen, so a relay elsewhere reports to the same ones. Through
    ``--set`` too, where an unquoted name is a string."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "trackio" else find_spec(name)
    )
    config = validate_config({**MINIMAL, "tracking": {"report_to": given}})
    assert config.tracking.report_to == chosen
    assert json.loads(config.resolved_json())["tracking"]["report_to"] == list(chosen)
    said = [r.getMessage() for r in caplog.records if "report_to = 'all'" in r.getMessage()]
    if "all" in given:
        assert said == [
            "tracking.report_to = 'all': reporting to tensorboard, wandb (the trackers installed here, of "
            "tensorboard, trackio, wandb)"
        ]
    else:
        assert said == []
    if isinstance(given, str):
        path = tmp_path / "c.toml"
        path.write_text("[model.tiny]\n[diloco]\nsync_every = 4\nrounds = 2\n")
        assert load_config(path, [f"tracking.report_to={given}"]).tracking.report_to == chosen


@pytest.mark.parametrize("given", [["all", "wandb"], ["none", "none"]])
def test_all_and_none_stand_alone(given) -> None:
    with pytest.raises(ConfigError, match=r"'all' and 'none' stand alone: report_to = \["):
        validate_config({**MINIMAL, "tracking": {"report_to": given}})


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


def test_trackio_and_wandb_take_the_completions_table(tmp_path) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    from tests.tracking.wandb_records import history

    project = f"tables-{tmp_path.name}"
    tracking = TrackingConfig(report_to=("trackio", "wandb"), project=project, wandb_mode="offline")
    rows = [[1, 0, "2+2?", "4", 1.0], [1, 1, "3+3?", "7", 0.0]]
    for name in ("trackio", "wandb"):
        tracker = trackers.open_tracker(name, tracking, "tabled", {"seed": 0}, tmp_path)
        tracker.log(1, {"train/loss": 2.0})
        tracker.table(1, "completions", ["round", "replica", "prompt", "completion", "reward"], rows)
        tracker.close()
    # finish() hands the run's last records to W&B's service process; teardown waits until it has written
    # them, so the transaction log read below is whole (one clean-clone run read it before it was).
    import wandb

    wandb.teardown()
    logged = SQLiteStorage.get_logs(project, "tabled")
    (table,) = [row["completions"] for row in logged if "completions" in row]
    assert [(r["prompt"], r["completion"], r["reward"]) for r in table["_value"]] == [
        ("2+2?", "4", 1.0),
        ("3+3?", "7", 0.0),
    ]
    (wandb_row,) = [row for row in history(tmp_path) if "completions/_type" in row]
    assert wandb_row["completions/_type"] == "table-file" and wandb_row["_step"] == 1
    (saved,) = tmp_path.glob(f"wandb/offline-run-*/files/{wandb_row['completions/path']}")
    assert json.loads(saved.read_text())["data"] == rows

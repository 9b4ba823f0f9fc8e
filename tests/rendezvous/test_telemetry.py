"""A replica's heartbeat: a step's figures stay in the beats after it that have none of their own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from composer_serverless.rendezvous import telemetry
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter, read_heartbeats


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The reporter's clock, set by the test: which beats the throttle lets through is then exact."""
    now = [1000.0]
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(time=lambda: now[0]))
    return now


def test_a_beat_without_figures_carries_the_latest_steps_even_from_a_throttled_beat(tmp_path, clock) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    reporter = Reporter(store, 0)
    reporter.beat(state="starting")
    assert "loss" not in read_heartbeats(store)[0]
    reporter.beat(state="training", round=1, step=1, loss=2.5, reward=0.25)
    clock[0] += 0.5
    reporter.beat(state="training", round=1, step=2, loss=2.0, reward=0.5)  # within 2 s: not written
    assert read_heartbeats(store)[0]["step"] == 1
    clock[0] += 0.5
    reporter.beat(state="done", round=1, step=2)
    beat = read_heartbeats(store)[0]
    assert (beat["state"], beat["loss"], beat["reward"], beat["time"]) == ("done", 2.0, 0.5, 1001.0)


def test_an_lm_replicas_beats_carry_its_loss_alone(tmp_path, clock) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    reporter = Reporter(store, 3)
    reporter.beat(state="training", round=2, step=1, loss=4.25)
    reporter.beat(state="waiting for the round's harvest", round=2, step=1)
    beat = read_heartbeats(store)[3]
    assert beat["loss"] == 4.25 and "reward" not in beat
    assert beat["state"] == "waiting for the round's harvest"

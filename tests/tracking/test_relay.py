"""A real local run relayed to TensorBoard, trackio and W&B (offline), each read back with its own reader: the
launcher detaches after round 1, the replicas go on alone, and `status` after they ended relays the rest;
every inner step reaches each tracker exactly once."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless.config import validate_config
from composer_serverless.launch import launcher, runs
from composer_serverless.launch.watch import ReplicaView
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics
from composer_serverless.tracking import relay, series
from tests.conftest import TINY, cli_in_fresh_process
from tests.tracking.wandb_records import history

pytestmark = pytest.mark.slow

ROUNDS, H, REPLICAS = 4, 3, 2
STEPS = list(range(1, ROUNDS * H + 1))
PER_STEP = ["train/loss", "train/lr", "train/grad_norm", "train/tokens", "train/tokens_per_s", "lm/loss"]
TIME_SPLIT = ["time/forward_backward_s", "time/optimizer_s", "time/sync_s", "time/generate_s", "time/step_s"]


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    """The run, detached once round 1 is complete; `status` (in a fresh process) once its replicas are done."""
    tmp = tmp_path_factory.mktemp("tracking")
    config = validate_config(
        {
            "run_id": "tracked",
            "store": str(tmp / "store"),
            "model": {"tiny": TINY.model_dump()},
            "data": {"seq_len": 32, "batch_size": 4},
            "train": {"lr": 1e-2},
            "diloco": {"replicas": REPLICAS, "sync_every": H, "rounds": ROUNDS},
            "eval": {"sequences": 8},
            "executor": {"threads_per_replica": 1},
            "tracking": {
                "report_to": ["tensorboard", "trackio", "wandb"],
                "project": f"relay-{tmp.name}",
                "wandb_mode": "offline",
                "dir": str(tmp / "tracking"),
            },
        }
    )
    run = ObjectStore(str(tmp / "store")).child("tracked")
    # The replicas are held still (SIGSTOP) the moment round 1 is complete, by a thread of the test's own,
    # however long the launcher takes meanwhile (opening W&B on a busy machine takes seconds), so that the
    # launcher's last relay, as it detaches, sees round 1 and not the whole run.
    stopped: list[psutil.Process] = []
    held = threading.Event()
    hold = threading.Thread(target=_hold_after_round_1, args=(run, stopped, held), daemon=True)
    hold.start()
    show = ReplicaView.show

    def detach_once_held(view, followed, beats):
        show(view, followed, beats)
        if held.is_set():
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReplicaView, "show", detach_once_held)
        summary = launcher.launch(config, "tracked.toml", Console(file=io.StringIO()), lambda: "detach")
    assert summary is None, "the launcher detached"
    at_detach = relay.cursors(run, config.tracking.report_to)
    for process in stopped:
        process.resume()
    try:
        deadline = time.monotonic() + 300
        while not all(b.get("state") == "done" for b in read_heartbeats(run).values()):
            assert time.monotonic() < deadline, read_heartbeats(run)
            time.sleep(0.5)
    finally:
        runs.cancel(run.url)  # nothing left running if the wait failed; ended replicas are left as they are
    status, loaded = cli_in_fresh_process("status", run.url)
    assert status.returncode == 0, status.stdout + status.stderr
    return run, config, at_detach, status.stdout, loaded


def _hold_after_round_1(run: ObjectStore, stopped: list[psutil.Process], held: threading.Event) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):  # the run's directories are not there yet
            if series.ready(read_metrics(run), 1, ended=False):
                stopped.extend(p for p in psutil.Process().children(recursive=True) if _is_replica(p))
                for process in stopped:
                    process.suspend()
                held.set()
                return
        time.sleep(0.05)


def _is_replica(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "composer_serverless.replicas.worker" in " ".join(process.cmdline())
    return False


def test_the_detached_launcher_relayed_round_1_and_status_the_rest(relayed):
    run, _, at_detach, stdout, loaded = relayed
    assert set(at_detach) == {"tensorboard", "trackio", "wandb"}
    assert all(1 <= k < ROUNDS for k in at_detach.values()), at_detach
    logged = (ROUNDS - at_detach["tensorboard"]) * H
    assert f"trackers (tensorboard, trackio, wandb): {logged} new steps logged" in stdout
    assert relay.cursors(run, list(at_detach)) == dict.fromkeys(at_detach, ROUNDS)
    assert relay.holder(run) is None, "each relay gave its lease up"
    assert loaded == [], "status relays without the training stack"


def test_tensorboard_holds_every_step_once_with_the_per_step_keys(relayed):
    run, _, _, _, _ = relayed
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    for key in PER_STEP + TIME_SPLIT:
        assert [e.step for e in events.Scalars(key)] == STEPS, key
    # Per round, at its last step: the held-out loss (and the initial model's at step 0), the exchange.
    assert [e.step for e in events.Scalars("eval/loss")] == [0, *range(H, ROUNDS * H + 1, H)]
    for key in ("round/bytes_up", "round/sync_s", "round/blocked_fraction", "round/quorum"):
        assert [e.step for e in events.Scalars(key)] == list(range(H, ROUNDS * H + 1, H)), key
    assert {e.value for e in events.Scalars("round/quorum")} == {REPLICAS}


def test_the_relayed_loss_is_the_replicas_mean_from_the_store(relayed):
    run, _, _, _, _ = relayed
    metrics = read_metrics(run)
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    for k in range(1, ROUNDS + 1):
        rows = [r for rank_rows in metrics.values() for r in rank_rows if r["round"] == k]
        assert len(rows) == REPLICAS and all(len(r["step_rows"]) == H for r in rows)
        for i in range(H):
            expected = sum(r["step_rows"][i]["loss"] for r in rows) / REPLICAS
            assert loss[(k - 1) * H + i + 1] == pytest.approx(expected, rel=1e-6)  # float32 in the event
        # The round's train loss is the mean of its steps' (the same numbers, kept in one place).
        for r in rows:
            assert r["train_loss"] == pytest.approx(sum(s["loss"] for s in r["step_rows"]) / H, rel=1e-6)


def test_trackio_reads_back_every_step_once(relayed):
    _, config, _, _, _ = relayed
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(config.tracking.project, "tracked")
    for key in PER_STEP:
        assert [row["step"] for row in logs if key in row] == STEPS, key


def test_the_wandb_offline_runs_hold_every_step_once(relayed):
    _, config, _, _, _ = relayed
    rows = history(Path(config.tracking.dir) / "tracked")
    steps = sorted(row["_step"] for row in rows if "train/loss" in row)
    assert steps == STEPS
    assert all(key in row for row in rows if "train/loss" in row for key in PER_STEP)

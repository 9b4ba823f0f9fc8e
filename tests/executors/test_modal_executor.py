"""Modal without a Modal account: the plan (no network), the replica function's body through Modal's own
``.local()``, ``modal run --help``, and the executor against a fake of the Modal SDK that behaves as the real
client does (``fake_modal.py``): the launch with Ctrl-C at every point of the spawn loop, cancellation from
the dashboard, logs in chunks, API errors, and (slow) whole runs.
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
from modal import exception as mx
from rich.console import Console

from composer_serverless.accelerator import ACCELERATOR_ENV, SIMULATED_ENV
from composer_serverless.config import validate_config
from composer_serverless.executors.base import (
    BackendError,
    LaunchPlan,
    LaunchRecord,
    ReplicaHandle,
    worker_argv,
)
from composer_serverless.executors.modal import ModalExecutor, whole_lines
from composer_serverless.executors.modal_image import IMAGE_REQUIREMENTS
from composer_serverless.executors.runtime import torch_build
from composer_serverless.launch import runs, watch
from composer_serverless.launch.launcher import create_run, launch, prepare, resume, start
from composer_serverless.launch.supervisor import RunCancelled, RunFailed, Supervisor
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from tests.conftest import TINY
from tests.executors.fake_modal import FakeModal, interrupt_points, unrecorded_live_calls

REPO = Path(__file__).resolve().parents[2]
WAIT = [sys.executable, "-c", "import time; time.sleep(120)"]


# Decoupled mode's settings (docs/decoupled.md): learners and a syncer, rank ``replicas``.
DECOUPLED = {"mode": "decoupled", "embedding_average": "all"}


def _config(store: str, replicas: int = 2, rounds: int = 2, diloco: dict | None = None, **executor):
    return validate_config(
        {
            "run_id": executor.pop("run_id", "modal-run"),
            "store": store,
            "model": {"tiny": TINY.model_dump()},
            "data": {"seq_len": 32, "batch_size": 4},
            "diloco": {"replicas": replicas, "sync_every": 3, "rounds": rounds, **(diloco or {})},
            "eval": {"sequences": 8},
            "executor": {"type": "modal", "private_store_endpoint": True, **executor},
        }
    )


@pytest.fixture
def fake_modal(tmp_path, monkeypatch):
    fake = FakeModal(tmp_path)
    fake.install(monkeypatch)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")  # a user who ran `modal token new`
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    yield fake
    fake.kill_all()


def _supervisor(tmp_path, replicas: int = 2, retry_s: float = 60.0) -> Supervisor:
    """A started-to-be run of ``replicas`` Modal replicas whose record lives in a local directory."""
    config = _config("s3://bucket/runs", replicas=replicas, api_retry_s=retry_s)
    executor = ModalExecutor(retry_s=retry_s)
    plan = executor.plan(config, "s3://bucket/runs/modal-run")
    supervisor = Supervisor(ObjectStore(str(tmp_path / "run")), executor, LaunchRecord(plan, ()))
    supervisor.save()
    return supervisor


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
    assert res["app_per_replica"] is True
    assert res["image"] == {"python": "3.11", **torch_build(), "requirements": list(IMAGE_REQUIREMENTS)}
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
    """The image cannot read pyproject.toml in a container, so it lists the requirements: keep them equal
    (torch apart: the image installs the tested build first, ``test_images.py``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [r for r in project["dependencies"] if "python_version" not in r]
    extras = project["optional-dependencies"]
    declared += extras["s3"] + extras["hf"] + extras["parquet"]

    def name(requirement: str) -> str:
        return (
            requirement.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
        )

    assert sorted(map(name, IMAGE_REQUIREMENTS)) == sorted(set(map(name, declared)) - {"torch"})
    hub = next(r for r in IMAGE_REQUIREMENTS if r.startswith("huggingface_hub"))
    assert hub in project["optional-dependencies"]["hf"]  # the same floor in the image as in the package


def test_replica_function_body_runs_through_modal_local(tmp_path):
    from composer_serverless.executors.modal_app import train_replica

    config = _config(str(tmp_path / "store"), replicas=1)
    run, _ = create_run(config, "modal-local.toml", Console(file=io.StringIO()))
    assert train_replica.local(run.url, 0) == 0
    assert read_heartbeats(run)[0]["state"] == "done"
    assert run.exists("final/config.json")


def test_a_replica_that_exits_non_zero_raises_so_modal_retries_it(monkeypatch):
    """A replica of several ranks reports a dead rank with its exit status; Modal takes any returned value
    for a success, so the function raises instead."""
    from composer_serverless.executors.modal_app import train_replica
    from composer_serverless.replicas import worker

    monkeypatch.setattr(worker, "main", lambda argv: 1)
    with pytest.raises(RuntimeError, match="replica 3 exited with status 1"):
        train_replica.local("s3://bucket/runs/x", 3)


@pytest.mark.parametrize("choice", ["cancel", "detach"])
@pytest.mark.parametrize(("point", "rank"), interrupt_points(2), ids=lambda v: str(v))
def test_ctrl_c_at_any_point_of_the_spawn_loop_leaves_nothing_unrecorded(
    tmp_path, fake_modal, point, rank, choice
):
    """A real SIGINT at each point of the two replicas' spawn sequence (before an app exists, once it does,
    before a call exists, once it exists but before its id is returned, after, as the app's block is left).
    The launch finishes recording what it started, then the user's choice is honoured: cancel leaves
    nothing running, detach leaves every replica running and named in launch.json."""
    fake_modal.command = lambda run_url, r: WAIT
    fake_modal.interrupt_at = [(point, rank)]
    supervisor = _supervisor(tmp_path)
    supervisor.start(supervisor.record.plan, note=lambda line: None)
    assert supervisor.held_interrupt is not None and not fake_modal.interrupt_at

    config = _config("s3://bucket/runs")
    followed = watch.Followed(supervisor, config)
    console = Console(file=io.StringIO())
    record = lambda: LaunchRecord.from_json(supervisor.run.get("launch.json"))  # noqa: E731
    if choice == "cancel":
        with pytest.raises(RunCancelled, match="cancelled at your request"):
            watch.follow([followed], watch.ReplicaView(followed, console), lambda: "cancel", fail_fast=True)
        assert fake_modal.live() == [] and all(app.stopped for app in fake_modal.apps.values())
        assert record().cancelled
    else:
        assert not watch.follow(
            [followed], watch.ReplicaView(followed, console), lambda: "detach", fail_fast=True
        )
        assert len(fake_modal.live()) == 2 and not any(app.stopped for app in fake_modal.apps.values())
    assert unrecorded_live_calls(fake_modal, record()) == []
    assert sorted(h.rank for h in record().handles if h.created) == [0, 1]


def test_a_second_ctrl_c_stops_the_launch_at_once_and_cancels_what_it_started(tmp_path, fake_modal):
    """Two Ctrl-C while replica 0's call is being created: the launch stops there, and the call, recorded
    only by its app (its id was not returned yet), is ended by stopping that app."""
    fake_modal.command = lambda run_url, r: WAIT
    fake_modal.interrupt_at = [("spawn.created", 0), ("spawn.created", 0)]
    supervisor = _supervisor(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        supervisor.start(supervisor.record.plan, note=lambda line: None)
    (handle,) = LaunchRecord.from_json(supervisor.run.get("launch.json")).handles
    assert handle.rank == 0 and not handle.created and handle.meta["app_id"] in fake_modal.apps
    assert len(fake_modal.calls) == 1 and fake_modal.live() == []
    assert all(app.stopped for app in fake_modal.apps.values())


def test_the_run_key_reaches_the_replica_as_a_modal_secret_and_nowhere_else(
    tmp_path, fake_modal, monkeypatch
):
    from composer_serverless.rendezvous.runkey import ENV, RunKey

    monkeypatch.delenv(ENV, raising=False)
    key = RunKey.generate().hex()
    fake_modal.command = lambda run_url, r: WAIT
    config = _config("s3://bucket/runs", replicas=1)
    config = validate_config(
        {**config.model_dump(), "diloco": {**config.diloco.model_dump(), "authenticate": True}}
    )
    executor = ModalExecutor()
    plan = executor.plan(config, "s3://bucket/runs/modal-run")
    supervisor = Supervisor(ObjectStore(str(tmp_path / "run")), executor, LaunchRecord(plan, ()))
    executor.run_secrets[ENV] = key
    (handle,) = supervisor.start(plan, note=lambda line: None)
    assert fake_modal.calls[handle.backend_id].env[ENV] == key  # delivered through Secret.from_dict
    assert ENV in plan.replicas[0].secrets and key not in plan.to_json()
    assert key not in supervisor.run.get("launch.json").decode()
    assert all(key not in json.dumps({k: str(v) for k, v in o.items()}) for o in fake_modal.options)


def test_each_call_runs_in_the_app_recorded_for_it(tmp_path, fake_modal):
    """A with_options variant binds to the app it is first spawned in: each replica's call must be in its own
    recorded app, so that stopping that app ends it and nothing else."""
    fake_modal.command = lambda run_url, r: WAIT
    supervisor = _supervisor(tmp_path)
    zero, one = supervisor.start(supervisor.record.plan, note=lambda line: None)
    assert zero.meta["app_id"] != one.meta["app_id"]
    for handle in (zero, one):
        assert fake_modal.calls[handle.backend_id].app_id == handle.meta["app_id"]
        assert fake_modal.apps[handle.meta["app_id"]].calls == [handle.backend_id]

    supervisor.executor.cancel([zero])
    assert [s.state for s in supervisor.executor.status([zero, one])] == ["cancelled", "running"]


def test_a_replica_that_cannot_be_recorded_is_not_started(tmp_path, fake_modal):
    """The store refuses the record of the attempt: no call is spawned, and the app made for it is stopped."""

    class Unwritable:
        def launching(self, rank, meta):
            raise OSError("the store refused the write")

        def launched(self, handle):  # pragma: no cover - never reached
            raise AssertionError

    supervisor = _supervisor(tmp_path, replicas=1)
    with pytest.raises(OSError, match="refused"):
        supervisor.executor.launch(supervisor.record.plan, Unwritable())
    assert not fake_modal.calls and [app.stopped for app in fake_modal.apps.values()] == [True]


def test_a_call_cancelled_on_modal_reads_cancelled_not_failed(tmp_path, fake_modal):
    """The dashboard's cancel, and `modal app stop`, end a call with a terminated result, which the client
    raises as RemoteError: the replica is cancelled, and the watch ends the run as cancelled."""
    fake_modal.command = lambda run_url, r: WAIT
    supervisor = _supervisor(tmp_path)
    zero, one = supervisor.start(supervisor.record.plan, note=lambda line: None)
    executor = supervisor.executor
    assert [s.state for s in executor.status([zero, one])] == ["running", "running"]

    fake_modal.terminate(zero.backend_id)  # the dashboard's cancel
    fake_modal._stop(fake_modal.apps[one.meta["app_id"]])  # `modal app stop`
    statuses = executor.status([zero, one])
    assert [s.state for s in statuses] == ["cancelled", "cancelled"], statuses
    assert all("cancelled on Modal" in s.detail for s in statuses)
    with pytest.raises(RunCancelled, match="replica 0 was cancelled"):
        supervisor.poll()


def test_logs_come_in_whole_lines_and_tail_gives_the_last_ones(tmp_path, fake_modal):
    lines = [f"[replica 0] line {i} " + "x" * (i % 17) for i in range(40)]
    fake_modal.command = lambda run_url, r: [sys.executable, "-c", f"print({chr(10).join(lines)!r})"]
    supervisor = _supervisor(tmp_path, replicas=1)
    (handle,) = supervisor.start(supervisor.record.plan, note=lambda line: None)
    fake_modal.calls[handle.backend_id].proc.wait()
    chunks = [e.message for e in fake_modal._entries(fake_modal.calls[handle.backend_id])]
    assert any(not chunk.endswith("\n") and "\n" not in chunk for chunk in chunks)  # lines span entries
    executor = supervisor.executor
    assert list(executor.logs(handle)) == lines
    assert list(executor.logs(handle, tail=5)) == lines[-5:]
    assert list(executor.logs(handle, follow=True)) == lines
    assert list(whole_lines(["a", "b\nc", "\n", "d"])) == ["ab", "c", "d"]


def test_api_errors_read_as_messages_with_their_exit_status(tmp_path, fake_modal):
    executor = ModalExecutor(retry_s=0)
    supervisor = _supervisor(tmp_path, replicas=1, retry_s=0)
    fake_modal.fail("hello", mx.AuthError("Token ID is malformed"))
    with pytest.raises(BackendError, match="Modal rejected the token while checking the Modal token") as e:
        executor.check_access(supervisor.record.plan)
    assert e.value.exit_code == 2 and "modal token new" in str(e.value)

    fake_modal.command = lambda run_url, r: WAIT
    (handle,) = supervisor.start(supervisor.record.plan, note=lambda line: None)
    fake_modal.fail("get", mx.ResourceExhaustedError("Too many requests"))
    with pytest.raises(BackendError, match="Modal is refusing requests for now") as e:
        supervisor.executor.status([handle])
    assert e.value.exit_code == 1
    fake_modal.fail("cancel", mx.PermissionDeniedError("not your workspace"))
    with pytest.raises(
        BackendError, match="Modal denied the token permission while cancelling replica 0"
    ) as e:
        supervisor.executor.cancel([handle])
    assert e.value.exit_code == 2


@pytest.mark.parametrize(
    ("error", "says", "code"),
    [
        (
            mx.AuthError("Token ID is malformed"),
            "Modal rejected the token while reading the log of replica 0",
            2,
        ),
        (mx.ServiceError("stream reset"), "cannot reach Modal while reading the log of replica 0", 1),
    ],
)
def test_an_api_error_while_following_a_log_reads_as_a_message(tmp_path, fake_modal, error, says, code):
    """`logs --follow`: what the client's stream raises once its own retries are spent is the API's, not a
    crash of the command."""
    fake_modal.command = lambda run_url, r: WAIT
    supervisor = _supervisor(tmp_path, replicas=1)
    (handle,) = supervisor.start(supervisor.record.plan, note=lambda line: None)
    fake_modal.fail("logs", error)
    with pytest.raises(BackendError, match=says) as e:
        list(supervisor.executor.logs(handle, follow=True))
    assert e.value.exit_code == code and "fix:" in str(e.value)


def test_a_transient_error_is_retried_until_it_passes(tmp_path, fake_modal):
    fake_modal.command = lambda run_url, r: WAIT
    supervisor = _supervisor(tmp_path, replicas=1)
    (handle,) = supervisor.start(supervisor.record.plan, note=lambda line: None)
    fake_modal.fail("get", mx.ConnectionError("connection reset"), mx.ResourceExhaustedError("slow down"))
    assert supervisor.executor.status([handle])[0].state == "running"
    assert fake_modal.requests.count("get") == 3


@pytest.mark.slow
def test_launcher_drives_modal_through_the_sdk(tmp_path, s3_store, fake_modal):
    store, _ = s3_store
    out = io.StringIO()
    summary = launch(_config(store, status_poll_s=0.5), "modal.toml", Console(file=out, width=120))
    assert summary is not None and summary["rounds_committed"] == 2, out.getvalue()

    assert len(fake_modal.options) == 2  # one variant per replica, made in the replica's own app
    for options in fake_modal.options:
        assert options["gpu"] == "H100" and options["timeout"] == 6 * 3600
        assert options["retries"].max_retries == 2
        assert options["env"]["AWS_ENDPOINT_URL_S3"] == os.environ["AWS_ENDPOINT_URL_S3"]
    assert len(fake_modal.apps) == 2 and all(app.detach for app in fake_modal.apps.values())
    assert fake_modal.requests.count("hello") == 1  # the token was checked before anything was written

    # Another process: a fresh executor finds the calls through launch.json alone.
    opened, rows, _ = runs.status(f"{store}/modal-run")
    assert [r.state for r in rows] == ["succeeded", "succeeded"]
    assert {r.backend_id for r in rows} == set(fake_modal.calls)
    assert {h.meta["app_id"] for h in opened.record.handles} == set(fake_modal.apps)
    log = list(runs.logs(f"{store}/modal-run", 1, follow=False))
    call = fake_modal.calls[rows[1].backend_id]
    assert log == call.log.read_text().splitlines() and any("[replica 1]" in line for line in log)


def test_a_resume_stops_the_app_of_a_call_never_recorded_before_it_starts_another(s3_store, fake_modal):
    """The launcher died after spawning replica 0 but before recording its call id: that attempt reads
    `failed`, yet its call runs in its app. A resume that finds no replica running stops that app before it
    spawns the rank again."""

    class DiesBeforeTheId:
        def launching(self, rank, meta):
            self.pending = ReplicaHandle(rank, "", attempt=1, meta=dict(meta))
            return self.pending

        def launched(self, handle):
            raise OSError("the launcher was killed here")

    store, _ = s3_store
    config = _config(store, replicas=1, max_restarts=0, status_poll_s=0.5)
    run = ObjectStore(f"{store}/modal-run")
    run.put("run.json", config.resolved_json().encode())
    executor, journal = ModalExecutor(), DiesBeforeTheId()
    plan = executor.plan(config, run.url)
    fake_modal.command = lambda run_url, r: WAIT
    with pytest.raises(OSError, match="killed"):
        executor.launch(plan, journal)
    run.put("launch.json", LaunchRecord(plan, (journal.pending,)).to_json())
    (old,) = fake_modal.live()

    fake_modal.command = lambda run_url, r: [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(RunFailed, match="replica 0 failed"):  # the new attempt fails at once
        resume(run.url, Console(file=io.StringIO()))
    requests = fake_modal.requests
    respawned = max(i for i, request in enumerate(requests) if request == "spawn")
    assert requests.count("spawn") == 2 and "stop" in requests[:respawned]  # its app stopped, then a spawn
    assert old.result == ("terminated", "App was stopped")


@pytest.mark.slow
def test_cancel_from_another_process_ends_every_call_and_app(tmp_path, s3_store, fake_modal):
    store, _ = s3_store
    start(
        prepare(_config(store, rounds=500, run_id="modal-cancel"), "modal.toml"), Console(file=io.StringIO())
    )
    statuses = runs.cancel(f"{store}/modal-cancel")
    assert [s.state for s in statuses] == ["cancelled", "cancelled"]
    assert fake_modal.live() == [] and all(app.stopped for app in fake_modal.apps.values())


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


def test_a_decoupled_plan_adds_the_syncer_as_a_cpu_function_with_its_cost():
    config = _config(
        "s3://bucket/runs", diloco=DECOUPLED, syncer_cpu=4, syncer_memory_mb=16384, seconds_per_step=0.5
    )
    plan = ModalExecutor().plan(config, "s3://bucket/runs/modal-run")
    assert [s.rank for s in plan.replicas] == [0, 1, 2]  # the learners, then the syncer
    syncer = plan.replicas[2]
    assert syncer.command == worker_argv("s3://bucket/runs/modal-run", 2)
    assert ACCELERATOR_ENV not in syncer.env and plan.replicas[0].env[ACCELERATOR_ENV] == "cuda"
    assert syncer.secrets == plan.replicas[0].secrets
    assert plan.resources["syncer"] == {
        "rank": 2,
        "function": "syncer",
        "gpu": None,
        "cpu": 4.0,
        "memory_mb": 16384,
        "hardware": "Modal CPU function, 4 cores, 16384 MiB, no GPU",
    }
    # 4 cores x $0.0472 + 16 GiB x $0.0080 = $0.3168/hour; at most 1 syncer x (1 + 2 restarts) x 6 h;
    # expected as long as one learner: 300 s + 2 rounds x 3 steps x 0.5 s.
    cost = plan.syncer_cost
    assert cost is not None and cost.of == "syncer" and cost.gpus_per_replica == 0
    assert cost.price_per_replica_hour == pytest.approx(0.3168)
    assert cost.max_replica_hours == 18 and cost.max_usd == round(18 * 0.3168, 2)
    assert cost.expected_usd == round((300 + 2 * 3 * 0.5) / 3600 * 0.3168, 2)
    assert "syncer-hours" in cost.summary() and "the syncer to its timeout" in cost.summary()
    # The replicas' cost is still the two learners' (the syncer is not billed at a GPU's price).
    assert plan.cost.max_replica_hours == 2 * 3 * 6
    assert LaunchPlan.from_dict(json.loads(plan.to_json())) == plan
    lockstep = ModalExecutor().plan(_config("s3://bucket/runs"), "s3://bucket/runs/modal-run")
    assert lockstep.syncer_cost is None and lockstep.resources["syncer"] is None


def test_a_syncer_of_two_shards_is_two_cpu_functions_and_costs_twice_one():
    """``diloco.decoupled.syncer_shards = 2``: ranks 2 and 3 are the syncer's shards, each the syncer's CPU
    function with the single syncer's command, environment and secrets; together they cost twice one."""
    kw = {"syncer_cpu": 4, "syncer_memory_mb": 16384, "seconds_per_step": 0.5}
    one = ModalExecutor().plan(
        _config("s3://bucket/runs", diloco=DECOUPLED, **kw), "s3://bucket/runs/modal-run"
    )
    sharded = {**DECOUPLED, "decoupled": {"syncer_shards": 2}}
    plan = ModalExecutor().plan(
        _config("s3://bucket/runs", diloco=sharded, **kw), "s3://bucket/runs/modal-run"
    )
    assert [s.rank for s in plan.replicas] == [0, 1, 2, 3]  # the learners, then the syncer's shards
    for rank in (2, 3):
        shard = plan.replicas[rank]
        assert shard.command == worker_argv("s3://bucket/runs/modal-run", rank)
        assert shard.env == one.replicas[2].env and ACCELERATOR_ENV not in shard.env
        assert shard.secrets == one.replicas[2].secrets
    assert plan.syncer_ranks == (2, 3) and one.syncer_ranks == (2,)
    assert plan.resources["syncer"] == {**one.resources["syncer"], "ranks": [2, 3], "shards": 2}
    assert (
        plan.syncer_hardware() == "2 shards, ranks 2-3, each Modal CPU function, 4 cores, 16384 MiB, no GPU"
    )
    # Each shard at $0.3168/hour: at most 2 shards x (1 + 2 restarts) x 6 h; expected 2 x one learner's time.
    cost, single = plan.syncer_cost, one.syncer_cost
    assert cost is not None and single is not None and cost.shards == 2 and single.shards == 1
    assert cost.max_replica_hours == 36 == 2 * single.max_replica_hours
    assert cost.max_usd == round(36 * 0.3168, 2) == pytest.approx(2 * single.max_usd, abs=0.01)
    assert cost.expected_usd == round(2 * (300 + 2 * 3 * 0.5) / 3600 * 0.3168, 2)
    assert cost.expected_basis.startswith("2 shards, each as long as a learner: 2 rounds x 3 steps")
    assert "36.00 syncer-shard-hours, each of the syncer's 2 shards to its timeout" in cost.summary()
    assert "/syncer-shard-hour" in cost.summary()
    assert plan.cost == one.cost  # the learners' cost does not change
    assert LaunchPlan.from_dict(json.loads(plan.to_json())) == plan


@pytest.mark.slow
def test_a_decoupled_run_on_modal_runs_its_syncer_as_a_cpu_function_beside_the_learners(
    tmp_path, s3_store, fake_modal
):
    store, _ = s3_store
    out = io.StringIO()
    config = _config(store, diloco=DECOUPLED, status_poll_s=0.5, run_id="modal-decoupled")
    summary = launch(config, "modal.toml", Console(file=out, width=120))
    assert summary is not None and summary["rounds_committed"] == 2, out.getvalue()
    assert "2 modal replicas and the syncer (Modal CPU function, 2 cores" in out.getvalue()
    run = ObjectStore(f"{store}/modal-decoupled")
    final = versions.read_version(run, 2)  # both merges committed, each learner's contributions merged once
    assert final.consumed == {0: 2, 1: 2} and final.dropped == []

    by_function = {o["function"]: o for o in fake_modal.options}
    assert len(fake_modal.options) == 3 and set(by_function) == {"train_replica", "syncer"}
    syncer = by_function["syncer"]
    assert "gpu" not in syncer and syncer["cpu"] == 2.0 and syncer["memory"] == 8192
    assert syncer["retries"].max_retries == 2 and syncer["timeout"] == 6 * 3600
    assert syncer["env"]["AWS_ENDPOINT_URL_S3"] == os.environ["AWS_ENDPOINT_URL_S3"]
    calls = {c.rank: c for c in fake_modal.calls.values()}
    assert calls[2].function == "syncer" and SIMULATED_ENV not in calls[2].env  # a container with no GPU
    assert calls[0].function == "train_replica" and calls[0].env[SIMULATED_ENV] == "1"
    # Its store credentials reached it as a secret (Secret.from_dict), not in its env.
    assert calls[2].env["AWS_SECRET_ACCESS_KEY"] == os.environ["AWS_SECRET_ACCESS_KEY"]
    assert "AWS_SECRET_ACCESS_KEY" not in syncer["env"]
    assert len(fake_modal.apps) == 3 and any(
        app.name.endswith("syncer 2") for app in fake_modal.apps.values()
    )
    _, rows, _ = runs.status(run.url)
    assert [r.state for r in rows] == ["succeeded"] * 3


@pytest.mark.slow
def test_cancelling_a_decoupled_run_on_modal_ends_the_learners_and_the_syncer(s3_store, fake_modal):
    store, _ = s3_store
    config = _config(store, rounds=500, diloco=DECOUPLED, run_id="modal-decoupled-cancel")
    start(prepare(config, "modal.toml"), Console(file=io.StringIO()))
    statuses = runs.cancel(f"{store}/modal-decoupled-cancel")
    assert [s.state for s in statuses] == ["cancelled"] * 3
    assert {c.function for c in fake_modal.calls.values()} == {"train_replica", "syncer"}
    assert fake_modal.live() == [] and all(app.stopped for app in fake_modal.apps.values())


@pytest.mark.slow
def test_cancelling_a_decoupled_run_on_modal_ends_every_syncer_shard(s3_store, fake_modal):
    """Two syncer shards are two spawns of the syncer's function, each in an app of its own; a cancel stops
    them with the learners."""
    store, _ = s3_store
    sharded = {**DECOUPLED, "decoupled": {"syncer_shards": 2}}
    config = _config(store, rounds=500, diloco=sharded, run_id="modal-shards-cancel")
    start(prepare(config, "modal.toml"), Console(file=io.StringIO()))
    assert {c.rank: c.function for c in fake_modal.calls.values()} == {
        0: "train_replica",
        1: "train_replica",
        2: "syncer",
        3: "syncer",
    }
    assert sum(app.name.endswith(("syncer 2", "syncer 3")) for app in fake_modal.apps.values()) == 2
    shards = [o for o in fake_modal.options if o["function"] == "syncer"]
    assert [(o["cpu"], o["memory"], "gpu" in o) for o in shards] == [(2.0, 8192, False)] * 2
    assert len(fake_modal.live()) == 4  # every shard's container runs, beside the learners'
    statuses = runs.cancel(f"{store}/modal-shards-cancel")
    assert [(s.rank, s.state) for s in statuses] == [(r, "cancelled") for r in range(4)]
    assert fake_modal.live() == [] and all(app.stopped for app in fake_modal.apps.values())

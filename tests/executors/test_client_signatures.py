"""Every call the cloud executors make into ``huggingface_hub`` and ``modal`` fits the installed clients.

A keyword a client version does not have fails with a TypeError only when the call is made, at launch or
at status, on the user's machine (``huggingface_hub`` 1.16 had no ``run_job(name=)`` nor
``list_jobs(labels=)``). ``pyproject.toml`` sets the floor to the first version that has them all; these
tests hold the executors to the installed client: the HF executor is driven through every method against
an autospec of ``HfApi`` (which checks each call against the real signature), and the Modal executor is
driven through every method against the Modal fake, whose stand-ins bind every call to the real SDK's
signature.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from unittest import mock

from huggingface_hub import HfApi

from composer_serverless.config import validate_config
from composer_serverless.executors.base import LaunchRecord, ReplicaHandle
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from composer_serverless.executors.modal import ModalExecutor
from tests.conftest import TINY
from tests.executors.fake_modal import FakeModal


class _Journal:
    def __init__(self) -> None:
        self.handles: dict[tuple[int, int], ReplicaHandle] = {}

    def launching(self, rank: int, meta: dict[str, str]) -> ReplicaHandle:
        handle = ReplicaHandle(rank, "", attempt=1, meta=meta)
        self.handles[(rank, 1)] = handle
        return handle

    def launched(self, handle: ReplicaHandle) -> None:
        self.handles[(handle.rank, handle.attempt)] = handle


def _job(job_id: str, rank: int, stage: str = "RUNNING") -> SimpleNamespace:
    return SimpleNamespace(
        id=job_id,
        url=f"https://hub.example/jobs/tester/{job_id}",
        labels={"run_id": "sig", "rank": str(rank), "attempt": "1"},
        status=SimpleNamespace(stage=stage, message=None),
    )


def test_every_hub_call_of_the_hf_executor_fits_the_installed_client(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    api = mock.create_autospec(HfApi, instance=True)
    api.endpoint = "https://hub.example"
    api.whoami.return_value = {"name": "tester"}
    api.run_job.side_effect = [_job("j0", 0), _job("j1", 1)]
    api.list_jobs.return_value = [_job("j0", 0)]  # j1 left out: asked for by id
    api.inspect_job.return_value = _job("j1", 1)
    api.fetch_job_logs.return_value = iter(["a", "b"])
    config = validate_config(
        {
            "run_id": "sig",
            "store": "s3://bucket/runs",
            "model": {"tiny": TINY.model_dump()},
            "diloco": {"replicas": 2, "sync_every": 1, "rounds": 1},
            "executor": {"type": "hf_jobs", "image": "img:1", "private_store_endpoint": True},
        }
    )
    executor = HFJobsExecutor(api=api, retry_s=0)
    plan = executor.plan(config, "s3://bucket/runs/sig")
    executor.check_access(plan)
    journal = _Journal()
    handles = executor.launch(plan, journal)
    assert [s.state for s in executor.status(handles)] == ["running", "running"]
    assert list(executor.logs(handles[0], follow=False, tail=2)) == ["a", "b"]
    executor.cancel(handles[:1])
    api.list_jobs.return_value = [_job("j0", 0, "CANCELED"), _job("j1", 1, "CANCELED")]
    executor.cancel_run(LaunchRecord(plan, tuple(handles)))
    for method in ("whoami", "list_jobs", "run_job", "inspect_job", "fetch_job_logs", "cancel_job"):
        assert getattr(api, method).called, method
    assert api.run_job.call_args.kwargs["labels"] == {"run_id": "sig", "rank": "1", "attempt": "1"}


def test_every_modal_call_of_the_modal_executor_fits_the_installed_sdk(tmp_path, monkeypatch):
    """The executor driven through every method against the Modal fake, whose stand-ins bind each call to the
    installed SDK's signature (and whose ``with_options`` and ``Secret.from_dict`` are the real ones); the
    rest (``Retries``, ``Secret.from_name``, ``enable_output``) is the real SDK, offline."""
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-printed")
    fake = FakeModal(tmp_path)
    fake.install(monkeypatch)
    fake.command = lambda run_url, rank: [sys.executable, "-c", f"print('replica {rank}')"]
    config = validate_config(
        {
            "run_id": "sig",
            "store": "s3://bucket/runs",
            "model": {"tiny": TINY.model_dump()},
            "diloco": {"replicas": 2, "sync_every": 1, "rounds": 1},
            "executor": {"type": "modal", "private_store_endpoint": True, "modal_secrets": ["wandb"]},
        }
    )
    executor = ModalExecutor(retry_s=0)
    plan = executor.plan(config, "s3://bucket/runs/sig")
    try:
        executor.check_access(plan)
        handles = executor.launch(plan, _Journal())
        # Followed to their ends: both calls have ended when the status is asked.
        assert [list(executor.logs(h, follow=True)) for h in handles] == [["replica 0"], ["replica 1"]]
        assert [s.state for s in executor.status(handles)] == ["succeeded", "succeeded"]
        assert list(executor.logs(handles[0])) == list(executor.logs(handles[0], tail=1)) == ["replica 0"]
        executor.cancel(handles[:1])
        executor.cancel_run(LaunchRecord(plan, tuple(handles)))
    finally:
        fake.kill_all()
    assert fake.used == {
        "App.run",
        "App.lookup",
        "App.stop",
        "Function.with_options",
        "Function.spawn",
        "FunctionCall.from_id",
        "FunctionCall.get",
        "FunctionCall.cancel",
        "Client.from_env",
        "Client.hello",
        "Secret.from_dict",
        "logs.fetch",
        "logs.tail",
        "logs.stream",
    }

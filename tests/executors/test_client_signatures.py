"""Every call the cloud executors make into ``huggingface_hub`` and ``modal`` fits the installed clients.

A keyword a client version does not have fails with a TypeError only when the call is made, at launch or
at status, on the user's machine (``huggingface_hub`` 1.16 had no ``run_job(name=)`` nor
``list_jobs(labels=)``). ``pyproject.toml`` sets the floor to the first version that has them all; these
tests hold the executors to the installed client: the HF executor is driven through every method against
an autospec of ``HfApi`` (which checks each call against the real signature), and each Modal call is bound
to the real SDK's signature.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from unittest import mock

import modal
import pytest
from huggingface_hub import HfApi

from composer_serverless.config import validate_config
from composer_serverless.executors.base import LaunchRecord, ReplicaHandle
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from tests.conftest import TINY


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


@pytest.mark.parametrize(
    ("target", "args", "kwargs"),
    [
        ("App.run", (), {"detach": True, "name": "run replica 0"}),
        ("App.lookup", ("ap-123",), {}),
        ("App.stop", (), {}),
        (
            "Function.with_options",
            (),
            {"gpu": "H100", "timeout": 60, "retries": None, "secrets": [], "env": {}},
        ),
        ("Function.spawn", ("s3://b/r", 0), {}),
        ("FunctionCall.from_id", ("fc-1",), {}),
        ("FunctionCall.get", (), {"timeout": 0}),
        ("FunctionCall.cancel", (), {"terminate_containers": True}),
        ("Client.from_env", (), {}),
        ("Client.hello", (), {}),
        ("Secret.from_dict", ({"A": "b"},), {}),
        ("Secret.from_name", ("name",), {}),
        ("Retries", (), {"max_retries": 2, "initial_delay": 10.0, "backoff_coefficient": 1.0}),
    ],
)
def test_every_modal_call_of_the_modal_executor_fits_the_installed_sdk(target, args, kwargs):
    owner, _, name = target.partition(".")
    obj = getattr(modal, owner)
    fn = getattr(obj, name) if name else obj
    signature = inspect.signature(fn)
    # A method or a classmethod whose wrapper still shows its first parameter: bound as the object would.
    instance = (None,) if next(iter(signature.parameters), None) in ("self", "cls") else ()
    signature.bind(*instance, *args, **kwargs)


def test_every_modal_log_call_fits_the_installed_sdk():
    from modal._logs_manager import _FunctionCallLogsManager

    inspect.signature(_FunctionCallLogsManager.tail).bind(None, entries=120)
    inspect.signature(_FunctionCallLogsManager.fetch).bind(None)
    inspect.signature(_FunctionCallLogsManager.stream).bind(None)
    assert dataclasses.fields(modal.types.LogEntry)[0].name == "message"

"""The run key of an authenticated run travels as a secret by name: listed in the cloud plans' secrets (so the
backend delivers it as one), never flagged as missing by the preflight (the launcher makes it), its value
given by the executor only at launch, and never in a plan (``test_modal_executor.py`` follows it into a
replica's environment through the Modal SDK)."""

from __future__ import annotations

import pytest

from composer_serverless.config import validate_config
from composer_serverless.executors.environment import launch_secrets, secret_name_problems
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from composer_serverless.executors.modal import ModalExecutor
from composer_serverless.rendezvous.runkey import ENV, RunKey


def _config(executor: str, authenticate: bool):
    return validate_config(
        {
            "run_id": "keyed",
            "store": "s3://bucket/runs",
            "model": {"path": "org/model"},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2, "authenticate": authenticate},
            "executor": {"type": executor, "seconds_per_step": 0.05},
        }
    )


@pytest.mark.parametrize("executor", [ModalExecutor, HFJobsExecutor])
def test_cloud_plans_name_the_run_key_as_a_secret_only_when_the_run_authenticates(
    executor, monkeypatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    for endpoint in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # (another test's loopback S3 server)
        monkeypatch.delenv(endpoint, raising=False)
    name = executor.name
    keyed = executor().plan(_config(name, True), "s3://bucket/runs/keyed")
    plain = executor().plan(_config(name, False), "s3://bucket/runs/keyed")
    assert ENV in keyed.replicas[0].secrets and ENV not in plain.replicas[0].secrets
    assert not any(ENV in problem for problem in secret_name_problems(keyed.replicas[0].secrets))


def test_the_value_comes_from_the_run_not_the_environment(monkeypatch) -> None:
    key = RunKey.generate()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.delenv(ENV, raising=False)
    delivered = launch_secrets(("AWS_ACCESS_KEY_ID", ENV), {ENV: key.hex()})
    assert delivered == {"AWS_ACCESS_KEY_ID": "id", ENV: key.hex()}
    assert launch_secrets((ENV,), {}) == {}  # nothing made, nothing sent

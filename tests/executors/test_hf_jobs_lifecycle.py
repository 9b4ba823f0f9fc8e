"""HF Jobs, what a real service does that the happy path never shows: a listing that leaves a live job out,
a launcher killed with SIGKILL and resumed, and the API refusing (401, 402, 403, 429 with Retry-After) at
launch, status, logs and cancel. The real CLI and the real ``huggingface_hub`` client against the fake Jobs
API on loopback (``fake_hf_jobs.py``); replicas sync through a moto S3 server.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.executors.base import LaunchRecord, ReplicaHandle
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from tests.conftest import TINY
from tests.executors.conftest import HF_TOKEN, NAMESPACE, cli, cli_background, read_until, store_objects
from tests.executors.test_hf_jobs import _config, launch_until_training

pytestmark = pytest.mark.slow


def test_a_job_left_out_of_a_listing_is_not_started_twice(tmp_path, s3_store, fake_hf, hf_env):
    """The old executor took a job missing from one listing for failed and started a second beside it. Now
    it asks for the job by id: the run completes with one job per rank, and nothing runs after cancel."""
    store, client = s3_store
    fake_hf.omit_once(lambda job: job.stage[0] == "RUNNING" and job.spec["labels"]["rank"] == "1")
    result = cli("launch", str(_config(tmp_path, store, "hf-omit", rounds=3, restarts=2)), env=hf_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not fake_hf.omitted  # the listing did leave the job out once
    assert len(fake_hf.jobs) == 2 and fake_hf.max_live == {("hf-omit", "0"): 1, ("hf-omit", "1"): 1}
    (rank1,) = [job for job in fake_hf.jobs.values() if job.spec["labels"]["rank"] == "1"]
    assert f"/api/jobs/{NAMESPACE}/{rank1.id}" in [path for _, path in fake_hf.requests]  # asked by id
    summary = json.loads(client.get_object(Bucket="bucket", Key="runs/hf-omit/summary.json")["Body"].read())
    assert summary["rounds_committed"] == 3 and summary["replicas_bit_identical"] is True

    cancel = cli("cancel", f"{store}/hf-omit", env=hf_env)
    assert cancel.returncode == 0, cancel.stderr
    assert not fake_hf.live_jobs()


def test_a_launcher_killed_with_sigkill_is_resumed_by_adopting_its_jobs(tmp_path, s3_store, fake_hf, hf_env):
    """kill -9 of the launcher, then `launch --resume`: the two jobs still running are watched again, no
    second set is started, and `cancel` from a third process leaves nothing running."""
    store, client = s3_store
    run_url = f"{store}/hf-kill"
    launcher = launch_until_training(tmp_path, s3_store, "hf-kill", hf_env)
    launcher.kill()
    launcher.communicate()

    resumed = cli_background("launch", "--resume", run_url, env=hf_env)
    # Printed as the watch begins: whatever the resume starts has been created by then.
    seen = read_until(resumed, "estimated cost:")
    assert len(fake_hf.jobs) == 2 and len(fake_hf.live_jobs()) == 2
    assert fake_hf.max_live == {("hf-kill", "0"): 1, ("hf-kill", "1"): 1}

    cancel = cli("cancel", run_url, env=hf_env)
    assert cancel.returncode == 0, cancel.stderr
    out, err = resumed.communicate(timeout=120)
    out = seen + out
    assert resumed.returncode == 1 and "cancelled" in err, out + err
    assert "still has live replicas (0, 1): watching them again instead of starting a second set" in out
    assert not fake_hf.live_jobs() and all(job.proc.wait() != 0 for job in fake_hf.jobs.values())


def test_a_resume_ends_a_job_still_scheduling_before_it_starts_another(s3_store, fake_hf, monkeypatch):
    """The run's one job is past its scheduling deadline, so it reads `unscheduled` (terminal), yet the Hub
    may still start it: a resume that finds no replica running cancels it, and waits to see it cancelled,
    before it starts the rank again; never two live jobs of one rank."""
    from huggingface_hub import constants

    from composer_serverless.launch.launcher import resume
    from composer_serverless.launch.supervisor import RunFailed

    monkeypatch.setattr(constants, "ENDPOINT", fake_hf.url)  # read when HfApi is made
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    run_url = _existing_run(s3_store[0], fake_hf, past_deadline=True)  # no job gets hardware
    (old,) = fake_hf.jobs.values()
    out = io.StringIO()
    with pytest.raises(RunFailed, match="no replica ran: replica 0 got no hardware"):  # nor does the new one
        resume(run_url, Console(file=out, width=200))
    assert len(fake_hf.jobs) == 2 and old.stage[0] == "CANCELED"
    assert fake_hf.max_live == {("hf-existing", "0"): 1}
    assert "ending the earlier attempts that may still be live" in out.getvalue()
    assert "replica 0 attempt 1 (unscheduled)" in out.getvalue()


def _record(client, run_id: str) -> LaunchRecord:
    return LaunchRecord.from_json(
        client.get_object(Bucket="bucket", Key=f"runs/{run_id}/launch.json")["Body"].read()
    )


# In one interpreter whose environment points at the fake from the start: each CLI call's exit code and output.
# (Loggers bind the stream they find when they are set up: the CLI's is set up for each call, as a process
# would; huggingface_hub's when it is imported, before the first call captures the output.)
# A request to /next-call marks in the fake's log where each call starts.
_CLI_CALLS = """
import json, logging, os, sys, urllib.request
import huggingface_hub.utils.logging
from typer.testing import CliRunner
from composer_serverless.cli import app
results = []
for argv in json.loads(sys.argv[1]):
    logging.root.handlers.clear()
    try:
        urllib.request.urlopen(os.environ["HF_ENDPOINT"] + "/next-call")
    except OSError:
        pass
    r = CliRunner().invoke(app, argv)
    results.append({"argv": argv, "code": r.exit_code, "output": " ".join(r.output.split())})
print(json.dumps(results))
"""


@pytest.mark.parametrize(
    ("status", "code", "says"),
    [
        (401, 2, "the Hugging Face Hub rejected the token"),
        (402, 2, "payment required (HTTP 402"),
        (403, 2, "the token may not use HF Jobs in namespace 'tester'"),
        (429, 1, "the Hub is rate-limiting this token (HTTP 429)"),
    ],
)
def test_api_refusals_at_launch_status_logs_and_cancel_read_as_messages(
    tmp_path, s3_store, fake_hf, hf_env, status, code, says
):
    """Each refusal, at each command: exit 2 (the user must fix something) or 1 (transient, after retries that
    waited as long as Retry-After asked), one message with the fix, no traceback; a launch refused is
    refused before anything is written to the store."""
    store, client = s3_store
    existing = _existing_run(store, fake_hf)
    config = _config(tmp_path, store, f"hf-{status}", extra="api_retry_s = 3")
    for method in ("GET", "POST"):
        fake_hf.refuse(method, "/api/jobs", status, times=1000, headers={"Retry-After": "1"})
    calls = _cli_calls(
        hf_env,
        ["launch", str(config)],
        ["status", existing],
        ["logs", existing, "--rank", "0"],
        ["cancel", existing],
    )
    for call in calls:
        assert call["code"] == code, call
        assert says in call["output"] and "fix:" in call["output"], call
        assert "Traceback" not in call["output"], call
    assert not [key for key in store_objects(client) if key.startswith(f"runs/hf-{status}/")]
    assert not LaunchRecord.from_json(store_objects(client)["runs/hf-existing/launch.json"]).cancelled
    if status == 429:  # every command asked again, and every retry waited the second Retry-After asked for
        calls, times = [], []
        for _, path, t in fake_hf.request_times:
            if path == "/next-call":
                calls.append(times := [])
            elif path.startswith("/api/jobs"):
                times.append(t)
        assert len(calls) == 4 and all(len(times) > 1 for times in calls), calls
        assert min(b - a for times in calls for a, b in zip(times, times[1:], strict=False)) >= 1.0


def test_a_404_names_what_the_hub_does_not_know(fake_hf, monkeypatch):
    """The real client against the fake: the log of a job the Hub does not know says so (its namespace is the
    one it was created in, so setting executor.namespace would fix nothing); a listing in a namespace the Hub
    does not know says that, with that fix."""
    from huggingface_hub import HfApi

    from composer_serverless.executors.base import BackendError

    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    executor = HFJobsExecutor(api=HfApi(endpoint=fake_hf.url, token=HF_TOKEN), retry_s=0)
    meta = {"namespace": NAMESPACE, "run_id": "hf-gone"}
    with pytest.raises(BackendError) as gone:
        list(executor.logs(ReplicaHandle(0, "0123456789abcdef01234567", meta=meta)))
    said = str(gone.value)
    assert gone.value.exit_code == 2 and "executor.namespace" not in said, said
    assert f"HF Jobs does not know job 0123456789abcdef01234567 in namespace '{NAMESPACE}' (HTTP 404" in said
    assert "while reading the log of replica 0" in said and "fix: `composer-serverless status RUN`" in said

    with pytest.raises(BackendError) as unknown:
        executor.status([ReplicaHandle(0, "0123456789abcdef01234567", meta={**meta, "namespace": "nobody"})])
    said = str(unknown.value)
    assert unknown.value.exit_code == 2 and "HF Jobs does not know namespace 'nobody' (HTTP 404" in said
    assert "fix: set executor.namespace to an existing user or organisation" in said


class _Journal:
    def launching(self, rank: int, meta: dict[str, str]) -> ReplicaHandle:
        return ReplicaHandle(rank, "", attempt=1, meta=dict(meta))

    def launched(self, handle: ReplicaHandle) -> None:
        pass


def _one_replica_config(run_id: str, store: str, **executor: object):
    """A 1-replica run of the tiny model on HF Jobs (``executor``: more executor keys)."""
    return validate_config(
        {
            "run_id": run_id,
            "store": store,
            "model": {"tiny": TINY.model_dump()},
            "diloco": {"replicas": 1, "sync_every": 3, "rounds": 2},
            "executor": {
                "type": "hf_jobs",
                "image": "ghcr.io/example/composer-serverless:test",
                "namespace": NAMESPACE,
                "private_store_endpoint": True,
                **executor,
            },
        }
    )


def _creating(fake_hf, monkeypatch):
    """An HF executor (the real client, against the fake) and the plan of a 1-replica run whose job never
    gets hardware; and the count of job creations the fake was asked for."""
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    fake_hf.hold = lambda spec: True
    config = _one_replica_config("hf-create", "s3://bucket/runs")
    executor = HFJobsExecutor(api=HfApi(endpoint=fake_hf.url, token=HF_TOKEN), retry_s=5)
    plan = executor.plan(config, "s3://bucket/runs/hf-create")
    return (
        executor,
        plan,
        lambda: fake_hf.requests_to("POST", f"/api/jobs/{NAMESPACE}").count(f"/api/jobs/{NAMESPACE}"),
    )


def test_a_creation_that_may_have_created_the_job_is_not_sent_again(fake_hf, monkeypatch):
    """The Hub created the job but the client saw a 504, and the listing that follows misses the job: the
    request is not sent again (a second job would run beside the first); the launch stops, exit 1."""
    from composer_serverless.executors.base import BackendError

    executor, plan, creations = _creating(fake_hf, monkeypatch)
    fake_hf.fail_after_creating(f"/api/jobs/{NAMESPACE}", 504)
    fake_hf.omit_once(lambda job: True)
    with pytest.raises(BackendError) as failed:
        executor.launch(plan, _Journal())
    assert creations() == 1 and len(fake_hf.jobs) == 1 and not fake_hf.omitted
    said = str(failed.value)
    assert failed.value.exit_code == 1 and "the Hub failed (HTTP 504" in said
    assert "may still have created the job" in said and "fix: once the Hub answers again" in said
    assert "launch --resume s3://bucket/runs/hf-create" in said


def test_a_job_a_failed_creation_made_is_found_by_its_labels(fake_hf, monkeypatch):
    executor, plan, creations = _creating(fake_hf, monkeypatch)
    fake_hf.fail_after_creating(f"/api/jobs/{NAMESPACE}", 504)
    (handle,) = executor.launch(plan, _Journal())
    (job,) = fake_hf.jobs.values()
    assert creations() == 1 and handle.backend_id == job.id


def test_a_creation_refused_before_anything_was_done_is_retried(fake_hf, monkeypatch):
    """A 429 is the rate limiter's: nothing was created, so asking again (after Retry-After) is safe."""
    executor, plan, creations = _creating(fake_hf, monkeypatch)
    fake_hf.refuse("POST", f"/api/jobs/{NAMESPACE}", 429, headers={"Retry-After": "0"})
    (handle,) = executor.launch(plan, _Journal())
    (job,) = fake_hf.jobs.values()
    assert creations() == 2 and handle.backend_id == job.id


def test_a_request_that_never_connected_did_nothing():
    """What the real client raises when no connection was made (a closed port here; a name that does not
    resolve raises the same class) shows that nothing was created."""
    import socket

    from huggingface_hub import HfApi

    from composer_serverless.executors.hf_errors import nothing_done

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(Exception) as refused:  # noqa: B017 - the class is the client's to choose
        HfApi(endpoint=endpoint, token=HF_TOKEN).run_job(image="img", command=["true"], namespace=NAMESPACE)
    assert nothing_done(refused.value), type(refused.value)


def test_no_credits_when_the_jobs_are_created_stops_the_launch_with_the_fix(
    tmp_path, s3_store, fake_hf, hf_env
):
    """The Hub says 402 only when a job is created, after the run was written: the launch stops with the fix
    and no job of the run exists; the attempt it recorded first says so."""
    store, client = s3_store
    existing = _existing_run(store, fake_hf)  # its job waits for hardware
    fake_hf.refuse("POST", f"/api/jobs/{NAMESPACE}", 402, times=1000)
    launch, status = _cli_calls(
        hf_env, ["launch", str(_config(tmp_path, store, "hf-broke"))], ["status", existing]
    )
    assert launch["code"] == 2 and "payment required (HTTP 402" in launch["output"], launch
    assert "https://huggingface.co/settings/billing" in launch["output"]
    assert [job.spec["labels"]["run_id"] for job in fake_hf.jobs.values()] == ["hf-existing"]
    (handle,) = _record(client, "hf-broke").handles
    assert handle.rank == 0 and not handle.created  # the attempt was recorded before the request
    # The SCHEDULING stage, as status shows it.
    assert (
        status["code"] == 0 and "pending" in status["output"] and "Waiting for hardware" in status["output"]
    )


def _cli_calls(env: dict[str, str], *argvs: list[str]) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-c", _CLI_CALLS, json.dumps(list(argvs))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _existing_run(store: str, fake_hf, past_deadline: bool = False, api_retry_s: float = 3) -> str:
    """A launched run whose one job waits for hardware (``past_deadline``: for longer than its scheduling
    deadline): run.json and launch.json in the store, the job in the fake, written directly (no replica
    process). A job the run starts from here on is given up after 1 s without hardware."""
    from composer_serverless.rendezvous.store import ObjectStore

    run_url = f"{store}/hf-existing"
    config = _one_replica_config(
        "hf-existing", store, api_retry_s=api_retry_s, scheduling_deadline_s=1, status_poll_s=0.5
    )
    plan = HFJobsExecutor().plan(config, run_url)
    fake_hf.hold = lambda spec: True
    labels = {"run_id": "hf-existing", "rank": "0", "attempt": "1"}
    job = fake_hf._create(NAMESPACE, {"command": ["true"], "labels": labels})
    launched_at, deadline = (time.time() - 60, "1") if past_deadline else (time.time(), "1e9")
    meta = {"namespace": NAMESPACE, "run_id": "hf-existing", "launched_at": f"{launched_at:.3f}"}
    handle = ReplicaHandle(0, job.id, "", attempt=1, meta={**meta, "scheduling_deadline_s": deadline})
    run = ObjectStore(run_url)
    run.put("run.json", config.resolved_json().encode())
    run.put("launch.json", LaunchRecord(plan, (handle,), created_at=time.time()).to_json())
    return run_url


def test_a_spell_of_429s_prints_two_lines_not_one_per_retry(s3_store, fake_hf, hf_env):
    """The real CLI's `status` while the Hub rate-limits the job listing for 8 requests (about 12 s:
    huggingface_hub retries 5 times inside each of our attempts, so ours retries once): one line when the
    spell starts, one when it ends, and the answer; never a line per retry, nor a line twice
    (huggingface_hub's loggers have a handler of their own). A 30-request spell, 57 s, printed the same two
    lines (docs/RESULTS.md)."""
    existing = _existing_run(s3_store[0], fake_hf, api_retry_s=120)
    fake_hf.refuse("GET", "/api/jobs", 429, times=8, headers={"Retry-After": "1"})
    status = cli("status", existing, env=hf_env)
    assert status.returncode == 0, status.stderr
    lines = status.stderr.splitlines()
    assert len(lines) == 2, status.stderr
    assert (
        "the Hub is rate-limiting this token (HTTP 429)" in lines[0]
        and "retrying for up to 120 s" in lines[0]
    )
    assert "went through after 1 retry in" in lines[1]
    assert "Waiting for hardware" in status.stdout

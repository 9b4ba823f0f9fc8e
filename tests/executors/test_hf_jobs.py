"""HF Jobs end to end: the real CLI and the real huggingface_hub client against a fake Jobs API on loopback.

Each job's command runs as a local process; the replicas meet in a moto S3 server (``s3://bucket/runs``).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from composer_serverless.accelerator import ACCELERATOR_ENV
from tests.executors.conftest import (
    HF_TOKEN,
    NAMESPACE,
    SECRET_ACCESS_KEY,
    cli,
    cli_background,
    store_objects,
    write_config,
)

pytestmark = pytest.mark.slow


def _config(tmp_path, store, run_id, rounds=2, extra="", restarts=0):
    return write_config(
        tmp_path / f"{run_id}.toml",
        f"""
        run_id = "{run_id}"
        store = "{store}"

        [diloco]
        replicas = 2
        sync_every = 3
        rounds = {rounds}

        [executor]
        type = "hf_jobs"
        image = "ghcr.io/example/composer-serverless:test"
        flavor = "a10g-small"
        namespace = "{NAMESPACE}"
        timeout_s = 7200
        status_poll_s = 0.5
        max_restarts = {restarts}
        private_store_endpoint = true
        {extra}
        """,
    )


def test_two_replica_run_through_hf_jobs_then_status_logs_cancel_and_no_secret_anywhere(
    tmp_path, s3_store, fake_hf, hf_env
):
    store, client = s3_store
    run_url = f"{store}/hf-e2e"
    result = cli("launch", str(_config(tmp_path, store, "hf-e2e")), env=hf_env)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(client.get_object(Bucket="bucket", Key="runs/hf-e2e/summary.json")["Body"].read())
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"] is True
    assert "held-out loss of the global model" in result.stdout
    _check_job_specs(fake_hf, run_url)
    _check_polling(fake_hf)

    status = cli("status", run_url, env=hf_env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("succeeded") == 2 and all(job_id in status.stdout for job_id in fake_hf.jobs)
    assert "2/2" in status.stdout and "3/3" in status.stdout

    logs = [cli("logs", run_url, "--rank", str(rank), env=hf_env) for rank in (0, 1)]
    assert all(log.returncode == 0 for log in logs), [log.stderr for log in logs]
    assert (
        "[replica 1]" in logs[1].stdout
        and "round 2/2" in logs[1].stdout
        and "Job started" not in logs[1].stdout
    )

    # Cancelling jobs that already ended is not an error: a listing that shows them ended sends nothing; one
    # that leaves them out makes cancel ask by id, and the server's 4xx for an ended job is tolerated.
    for job_id in list(fake_hf.jobs):  # left out of cancel's access check and of its first listing
        fake_hf.omit_once(lambda job, job_id=job_id: job.id == job_id, listings=2)
    cancel = cli("cancel", run_url, env=hf_env)
    assert cancel.returncode == 0, cancel.stderr
    assert len(fake_hf.requests_to("POST", f"/api/jobs/{NAMESPACE}/")) == 2
    assert cancel.stdout.count("succeeded") == 2

    dry = cli("launch", str(_config(tmp_path, store, "dry")), "--dry-run", env=hf_env)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["replicas"][0]["secrets"] == [
        "HF_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    ]
    _check_no_secret_anywhere(
        client,
        fake_hf,
        {"launcher output": result.stdout + result.stderr, "dry-run plan": dry.stdout + dry.stderr}
        | {f"log of rank {rank}": log.stdout for rank, log in enumerate(logs)},
    )


def _check_job_specs(fake, run_url):
    specs = [job.spec for job in fake.jobs.values()]
    assert sorted(s["labels"]["rank"] for s in specs) == ["0", "1"]
    for spec in specs:
        assert spec["labels"]["run_id"] == "hf-e2e"
        assert spec["flavor"] == "a10g-small" and spec["timeoutSeconds"] == 7200
        assert spec["dockerImage"] == "ghcr.io/example/composer-serverless:test"
        assert spec["command"][:4] == ["python", "-u", "-m", "composer_serverless.replicas.worker"]
        assert spec["command"][-4:] == ["--run", run_url, "--rank", spec["labels"]["rank"]]
        # Credentials travel as secrets, under the names the user's environment has them; settings as env.
        assert set(spec["secrets"]) == {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert (
            spec["secrets"]["AWS_SECRET_ACCESS_KEY"] == SECRET_ACCESS_KEY
            and spec["secrets"]["HF_TOKEN"] == HF_TOKEN
        )
        assert "AWS_ENDPOINT_URL_S3" in spec["environment"] and not set(spec["environment"]) & set(
            spec["secrets"]
        )


def _check_polling(fake):
    """Every call named the namespace (so no whoami); status was one labelled list per poll, no inspects."""
    assert not fake.requests_to("GET", "/api/whoami-v2")
    lists = fake.requests_to("GET", f"/api/jobs/{NAMESPACE}?")
    assert lists and all(("label", "run_id=hf-e2e") in parse_qsl(urlsplit(p).query) for p in lists)
    inspects = [p for p in fake.requests_to("GET", f"/api/jobs/{NAMESPACE}/") if "/logs" not in p]
    assert not inspects


def _check_no_secret_anywhere(client, fake, texts):
    """argv, env and labels of every job, the outputs given, every object in the store (plan, run.json...)."""
    objects = store_objects(client)
    assert "runs/hf-e2e/launch.json" in objects and "runs/hf-e2e/run.json" in objects
    haystacks = dict(texts)
    for job in fake.jobs.values():
        for part in ("command", "environment", "labels"):
            haystacks[f"job {job.id} {part}"] = json.dumps(job.spec[part])
    haystacks |= {f"object {key}": data.decode("latin-1") for key, data in objects.items()}
    for secret in (SECRET_ACCESS_KEY, HF_TOKEN):
        leaks = [where for where, text in haystacks.items() if secret in text]
        assert not leaks, f"a secret value was found in {leaks}"


def test_detach_then_status_logs_and_cancel_from_other_processes(tmp_path, s3_store, fake_hf, hf_env):
    store, client = s3_store
    run_url = f"{store}/hf-detach"
    launcher = launch_until_training(tmp_path, s3_store, "hf-detach", hf_env)
    launcher.send_signal(signal.SIGINT)  # Ctrl-C: the launcher asks; answer "detach"
    out, err = launcher.communicate("d\n")
    assert launcher.returncode == 0, out + err
    assert "detached" in out and f"composer-serverless status {run_url}" in out

    status = cli("status", run_url, env=hf_env)
    assert status.returncode == 0 and status.stdout.count("running") >= 2, status.stdout + status.stderr
    logs = cli("logs", run_url, "--rank", "0", env=hf_env)
    assert logs.returncode == 0 and "[replica 0]" in logs.stdout, logs.stderr

    cancel = cli("cancel", run_url, env=hf_env)
    assert cancel.returncode == 0, cancel.stderr
    assert all(job.stage[0] == "CANCELED" for job in fake_hf.jobs.values())
    for job in fake_hf.jobs.values():
        assert job.proc.wait() != 0  # the replica process itself was ended
    status = cli("status", run_url, env=hf_env)
    assert status.stdout.count("cancelled") >= 2 and "(cancelled)" in status.stdout, status.stdout


def test_a_replica_stuck_in_scheduling_is_given_up(tmp_path, s3_store, fake_hf, hf_env):
    store, _ = s3_store
    fake_hf.hold = lambda spec: True  # no hardware, ever
    config = _config(tmp_path, store, "hf-stuck", extra="scheduling_deadline_s = 1")
    result = cli("launch", str(config), "--set", "diloco.replicas=1", env=hf_env)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "no replica ran: replica 0 got no hardware (still SCHEDULING after" in out
    assert "(deadline 1 s): Waiting for hardware" in out
    (job,) = fake_hf.jobs.values()
    assert job.stage[0] == "CANCELED"


def launch_until_training(tmp_path, s3_store, run_id: str, env: dict[str, str]):
    """``launch`` of a long 2-replica run in the background, returned once both replicas train."""
    store, client = s3_store
    launcher = cli_background("launch", str(_config(tmp_path, store, run_id, rounds=300)), env=env)
    while not _training(client, run_id, ranks=2):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.5)
    return launcher


def test_a_syncer_of_two_shards_on_hf_jobs_is_two_cpu_jobs_priced_together_and_a_cancel_ends_them(
    tmp_path, s3_store, fake_hf, hf_env
):
    """``diloco.decoupled.syncer_shards = 2``: the dry run shows both shards (ranks 2 and 3), their flavor and
    their cost, twice one syncer's; launched, each shard is a job on the CPU flavor beside the learners, and a
    cancel ends all four."""
    store, client = s3_store
    shards = ("--set", "diloco.decoupled.syncer_shards=2")
    dry = cli(
        "launch", str(_decoupled(tmp_path, store, "hf-shards", rounds=300)), "--dry-run", *shards, env=hf_env
    )
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert [r["rank"] for r in plan["replicas"]] == [0, 1, 2, 3]
    assert plan["replicas"][3]["command"][-2:] == ["--rank", "3"]
    assert plan["resources"]["syncer"] == {
        "rank": 2,
        "ranks": [2, 3],
        "shards": 2,
        "flavor": "cpu-upgrade",
        "hardware": "HF Jobs cpu-upgrade",
    }
    # cpu-upgrade at $0.03/hour: at most 2 shards x (1 + 0 restarts) x 2 h, twice one syncer's $0.06.
    assert plan["syncer_cost"]["max_usd"] == 0.12 and plan["syncer_cost"]["shards"] == 2
    text = " ".join(dry.stderr.split())  # whatever the terminal's width wrapped
    assert (
        "estimated cost of the syncer (2 shards, ranks 2-3, each HF Jobs cpu-upgrade): expected: no step time "
        in text
    )
    assert (
        "at most $0.12 (4.00 syncer-shard-hours, each of the syncer's 2 shards to its timeout with every "
        "restart) at $0.03/syncer-shard-hour (HF Jobs list price of cpu-upgrade)" in text
    )

    # Until the learners train and both shards have beaten (each as its own rank), then cancelled
    def started() -> bool:
        return _training(client, "hf-shards", ranks=2) and _syncers(client, "hf-shards", (2, 3))

    launched = cli_background(
        "launch", str(_decoupled(tmp_path, store, "hf-shards", rounds=300)), *shards, env=hf_env
    )
    flavors = _cancelled_once(launched, started, fake_hf, f"{store}/hf-shards", hf_env, jobs=4)
    assert flavors == {"0": "a10g-small", "1": "a10g-small", "2": "cpu-upgrade", "3": "cpu-upgrade"}


def _cancelled_once(launcher, started, fake_hf, run_url, env, jobs):
    """Wait until ``started()`` (the launcher still running), then ``cancel`` the run: its ``jobs`` jobs all
    end CANCELED, their processes gone. Returns each rank's flavor as it ran."""
    try:
        while not started():
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.5)
        flavors = {job.spec["labels"]["rank"]: job.spec["flavor"] for job in fake_hf.jobs.values()}
        assert all(job.proc.poll() is None for job in fake_hf.jobs.values())
        cancel = cli("cancel", run_url, env=env)
        assert cancel.returncode == 0, cancel.stderr
        assert len(fake_hf.jobs) == jobs and all(job.stage[0] == "CANCELED" for job in fake_hf.jobs.values())
        assert all(job.proc.wait() != 0 for job in fake_hf.jobs.values())
        return flavors
    finally:
        launcher.kill()
        launcher.communicate()


def _syncers(client, run_id, ranks):
    """True once every rank of ``ranks`` has beaten as a syncer does (``Syncer._beat``: one "step" per
    version; read straight from the S3 server)."""
    for rank in ranks:
        try:
            body = client.get_object(Bucket="bucket", Key=f"runs/{run_id}/members/{rank}.json")["Body"].read()
        except client.exceptions.NoSuchKey:
            return False
        beat = json.loads(body)
        if (beat.get("step"), beat.get("steps")) != (0, 1):
            return False
    return True


def _training(client, run_id, ranks):
    """True once every rank's heartbeat says it is training (read straight from the S3 server)."""
    beats = []
    for rank in range(ranks):
        try:
            body = client.get_object(Bucket="bucket", Key=f"runs/{run_id}/members/{rank}.json")["Body"].read()
        except client.exceptions.NoSuchKey:
            return False
        beats.append(json.loads(body))
    return all(b["state"] == "training" for b in beats)


def test_the_flavors_the_config_accepts_are_the_hub_clients_flavors() -> None:
    """The flavor list a config is validated against is the installed client's ``JobHardware``: a flavor the
    Hub added is not refused, and one it retired fails at validation, not at launch."""
    from huggingface_hub import JobHardware

    from composer_serverless.config.hardware import HF_FLAVOR_PRICES

    assert set(HF_FLAVOR_PRICES) == {flavor.value for flavor in JobHardware}


def test_a_job_fetches_the_runs_code_and_data_from_the_store_and_trains_with_them(
    tmp_path, s3_store, fake_hf, hf_env
):
    """A TRL reward in a file next to the config and data files on this machine: the launcher uploads both to
    the run's prefix, and each job fetches the code (checked against its manifest) and imports it."""
    from tests.test_own_task import write_task

    store, client = s3_store
    task = tmp_path / "task"
    executor = (
        f'[executor]\ntype = "hf_jobs"\nimage = "ghcr.io/example/composer-serverless:test"\nflavor = "a10g-small"\n'
        f'namespace = "{NAMESPACE}"\nstatus_poll_s = 0.5\nprivate_store_endpoint = true'
    )
    config = write_task(
        task,
        store=store,
        prompts=str(task / "train.jsonl"),
        heldout=str(task / "test.jsonl"),
        executor=executor,
    )
    result = cli("launch", str(config), "--set", "run_id=hf-own", env=hf_env)
    assert result.returncode == 0, result.stdout + result.stderr
    objects = store_objects(client)
    assert objects["runs/hf-own/code/my_task.py"] == (task / "my_task.py").read_bytes()
    assert json.loads(objects["runs/hf-own/code/manifest.json"])["files"].keys() == {"my_task.py"}
    assert objects["runs/hf-own/inputs/prompts/train.jsonl"] == (task / "train.jsonl").read_bytes()
    resolved = json.loads(objects["runs/hf-own/run.json"])
    assert resolved["composer"]["data"]["prompts"] == f"{store}/hf-own/inputs/prompts/train.jsonl"
    logs = [cli("logs", f"{store}/hf-own", "--rank", str(rank), env=hf_env).stdout for rank in (0, 1)]
    assert all(f"the run's code fetched from {store}/hf-own/code" in log for log in logs)
    row = json.loads(objects["runs/hf-own/metrics/0/000002.json"])
    assert "rollout/reward/accuracy" in row["train"]  # the user's reward ran in the job
    # The jobs' fetched code, model cache and sandboxes went with them (torch keeps its per-user compile cache
    # there, as it does in any process: its own, reused by the next).
    left = [p.name for p in Path(fake_hf.image_env["TMPDIR"]).iterdir()]
    assert [name for name in left if not name.startswith("torchinductor_")] == [], left


def test_a_job_fetches_the_tool_and_environment_files_installs_their_requirements_and_runs_episodes(
    tmp_path, s3_store, fake_hf, hf_env, tool_chat_model_dir
):
    """The agent task (a TRL tool function and environment class in files next to the config, the package
    the environment needs in [code] requirements) on 2 HF Jobs replicas x 2 rounds: the launcher uploads the
    files, each job installs the requirements, fetches the files (checked against the manifest), imports them
    and runs episodes against them, scored by a reward function and the environment's own reward."""
    from tests.environments.test_agent_task import REQUIREMENTS, write_task

    store, client = s3_store
    task = tmp_path / "task"
    executor = (
        'type = "hf_jobs"\nimage = "ghcr.io/example/composer-serverless:test"\nflavor = "a10g-small"\n'
        f'namespace = "{NAMESPACE}"\nstatus_poll_s = 0.5\nprivate_store_endpoint = true'
    )
    config = write_task(task, tool_chat_model_dir, executor=executor, extra=REQUIREMENTS)
    result = cli("launch", str(config), "--set", f"store={store}", "--set", "run_id=hf-agent", env=hf_env)
    assert result.returncode == 0, result.stdout + result.stderr
    objects = store_objects(client)
    for name in ("my_tools.py", "my_env.py"):
        assert objects[f"runs/hf-agent/code/{name}"] == (task / name).read_bytes()
    manifest = json.loads(objects["runs/hf-agent/code/manifest.json"])
    assert manifest["files"].keys() == {"my_tools.py", "my_env.py"}
    commands = [" ".join(job.spec["command"]) for job in fake_hf.jobs.values()]
    assert len(commands) == 2 and all(
        "pip install --quiet --no-cache-dir 'packaging>=20'" in c for c in commands
    )
    logs = [cli("logs", f"{store}/hf-agent", "--rank", str(rank), env=hf_env).stdout for rank in (0, 1)]
    assert all(f"the run's code fetched from {store}/hf-agent/code" in log for log in logs)
    summary = json.loads(objects["runs/hf-agent/summary.json"])
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    for rank in (0, 1):
        trained = [
            json.loads(objects[f"runs/hf-agent/metrics/{rank}/00000{r}.json"])["train"] for r in (1, 2)
        ]
        # The episodes ran in the job against the fetched files: the environment's reward and the turns.
        assert all({"rollout/reward/Vault", "rollout/reward/exact_match"} <= t.keys() for t in trained)
        assert all(1 <= t["rollout/turns"] <= 2 for t in trained)


def test_a_model_directory_next_to_the_config_is_shipped_to_the_jobs_and_trained(
    tmp_path, s3_store, fake_hf, hf_env, tiny_model_dir
):
    """``model.path = "my-model"`` names a directory beside the config (a clone of its Hub repository, .git
    and all): the launcher checks it here, uploads it to the run's model/ without the hidden files, and each
    job downloads it and loads it with from_pretrained."""
    import shutil

    from tests.test_own_task import write_task

    store, client = s3_store
    task = tmp_path / "task"
    shutil.copytree(tiny_model_dir, task / "my-model")
    (task / "my-model" / ".git").mkdir()
    (task / "my-model" / ".git" / "packed").write_bytes(b"\0" * 100)
    executor = (
        f'[executor]\ntype = "hf_jobs"\nimage = "ghcr.io/example/composer-serverless:test"\nflavor = "a10g-small"\n'
        f'namespace = "{NAMESPACE}"\nstatus_poll_s = 0.5\nprivate_store_endpoint = true'
    )
    config = write_task(task, store=store, model='[model]\npath = "my-model"', executor=executor)
    result = cli("launch", str(config), "--set", "run_id=hf-model", env=hf_env)  # from the repository
    assert result.returncode == 0, result.stdout + result.stderr
    objects = store_objects(client)
    files = sorted(p.relative_to(tiny_model_dir).as_posix() for p in tiny_model_dir.rglob("*") if p.is_file())
    assert sorted(k.removeprefix("runs/hf-model/model/") for k in objects if "/model/" in k) == files
    assert all(objects[f"runs/hf-model/model/{f}"] == (tiny_model_dir / f).read_bytes() for f in files)
    resolved = json.loads(objects["runs/hf-model/run.json"])
    assert resolved["model"]["path"] == f"{store}/hf-model/model"
    assert json.loads(objects["runs/hf-model/summary.json"])["rounds_committed"] == 2


def _decoupled(tmp_path, store, run_id, rounds):
    """``_config``'s run in decoupled mode: 2 learners and the syncer (rank 2)."""
    path = _config(tmp_path, store, run_id, rounds=rounds)
    path.write_text(
        path.read_text().replace("[diloco]\n", '[diloco]\nmode = "decoupled"\nembedding_average = "all"\n')
    )
    return path


def test_a_decoupled_run_on_hf_jobs_runs_its_syncer_on_a_cpu_flavor_and_a_cancel_ends_all_three(
    tmp_path, s3_store, fake_hf, hf_env
):
    store, client = s3_store
    config = _decoupled(tmp_path, store, "hf-decoupled", rounds=2)
    dry = cli("launch", str(config), "--dry-run", env=hf_env)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert [r["rank"] for r in plan["replicas"]] == [0, 1, 2]
    assert plan["resources"]["syncer"] == {
        "rank": 2,
        "flavor": "cpu-upgrade",
        "hardware": "HF Jobs cpu-upgrade",
    }
    # cpu-upgrade at $0.03/hour: at most 1 syncer x (1 + 0 restarts) x 2 h.
    assert plan["syncer_cost"]["max_usd"] == 0.06 and plan["syncer_cost"]["of"] == "syncer"
    assert "estimated cost of the syncer (HF Jobs cpu-upgrade): " in dry.stderr

    result = cli("launch", str(config), env=hf_env)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(
        client.get_object(Bucket="bucket", Key="runs/hf-decoupled/summary.json")["Body"].read()
    )
    assert summary["rounds_committed"] == 2
    flavors = {job.spec["labels"]["rank"]: job.spec["flavor"] for job in fake_hf.jobs.values()}
    assert flavors == {"0": "a10g-small", "1": "a10g-small", "2": "cpu-upgrade"}
    syncer = next(job for job in fake_hf.jobs.values() if job.spec["labels"]["rank"] == "2")
    assert set(syncer.spec["secrets"]) == {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert ACCELERATOR_ENV not in syncer.spec["environment"]

    # A long run, cancelled once its learners train: learners and syncer all end.
    fake_hf.reset()
    launcher = cli_background("launch", str(_decoupled(tmp_path, store, "hf-dc-cancel", 300)), env=hf_env)

    def training() -> bool:
        return _training(client, "hf-dc-cancel", ranks=2)

    _cancelled_once(launcher, training, fake_hf, f"{store}/hf-dc-cancel", hf_env, jobs=3)

"""Every wrong input fails before anything is launched or written: exit status 2 and one clear message.

Each case runs the real CLI in-process with every executor's ``launch`` replaced by a recorder, then checks
that nothing was launched and that neither the local store nor the S3 bucket holds anything.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.executors.hf_jobs import HFJobsExecutor
from composer_serverless.executors.local import LocalProcessExecutor
from composer_serverless.executors.modal import ModalExecutor
from tests.executors.conftest import HF_TOKEN, store_objects, write_config

S3 = "s3://bucket/runs"
# The tests' S3 server is on loopback, which cloud replicas could not reach: the flag says they can.
PRIVATE_OK = ["--set", "executor.private_store_endpoint=true"]
HF_UNFLAGGED = [
    "--executor",
    "hf_jobs",
    "--set",
    f"store={S3}",
    "--set",
    "executor.image=ghcr.io/example/composer-serverless:1",
]
HF = [*HF_UNFLAGGED, *PRIVATE_OK]
MODAL = ["--executor", "modal", "--set", f"store={S3}", *PRIVATE_OK]

# (what is wrong, CLI arguments, environment changes (None unsets), what the message must say)
CASES = [
    (
        "missing HF token",
        ["launch", "{cfg}", *HF],
        {"HF_TOKEN": None},
        ["HF_TOKEN is not set", "hf auth login"],
    ),
    (
        "missing AWS keys for an s3:// store",
        ["launch", "{cfg}", *HF],
        {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
        ["AWS_ACCESS_KEY_ID is not set", "AWS_SECRET_ACCESS_KEY is not set", "export AWS_ACCESS_KEY_ID=..."],
    ),
    (
        "missing Modal token",
        ["launch", "{cfg}", *MODAL],
        {"MODAL_TOKEN_ID": None, "MODAL_TOKEN_SECRET": None},
        ["no Modal token", "fix: run `modal token new`"],
    ),
    (
        "missing HF token for the push at the end",
        ["launch", "{cfg}", "--set", "output.push_to_hub=me/tiny-diloco"],
        {"HF_TOKEN": None},
        ["output.push_to_hub = 'me/tiny-diloco' pushes the model when the run ends", "fix: export HF_TOKEN="],
    ),
    (
        "malformed Hub repo for the push at the end",
        ["launch", "{cfg}", "--set", "output.push_to_hub=me/two/slashes"],
        {},
        ["output.push_to_hub: 'me/two/slashes' is not a Hub repo id", "fix: use <user-or-org>/<name>"],
    ),
    (
        "unknown GPU type",
        ["launch", "{cfg}", *MODAL, "--set", "executor.gpu=H1000"],
        {},
        ["executor.gpu: unknown GPU type 'H1000'; did you mean 'H100'?", "fix: change executor.gpu"],
    ),
    (
        "a GPU flavor for the syncer, which merges on the CPU",
        ["launch", "{cfg}", *HF, "--set", "executor.syncer_flavor=a10g-small"],
        {},
        ["executor.syncer_flavor 'a10g-small' has GPUs", "fix: one of cpu-basic, cpu-upgrade"],
    ),
    (
        "unknown flavor",
        ["launch", "{cfg}", *HF, "--set", "executor.flavor=a100-hueg"],
        {},
        ["executor.flavor: unknown flavor 'a100-hueg'; did you mean 'a100-large'?"],
    ),
    (
        "replicas above the limit",
        ["launch", "{cfg}", *HF, "--replicas", "40"],
        {},
        ["diloco.replicas (40) exceeds executor.max_replicas (16)", "--set executor.max_replicas=40"],
    ),
    (
        "GPUs per replica above what a container takes",
        ["launch", "{cfg}", *MODAL, "--set", "executor.gpu_count=9"],
        {},
        ["executor.gpu_count: Input should be less than or equal to 8"],
    ),
    (
        "timeout too short for the configured steps",
        [
            "launch",
            "{cfg}",
            *MODAL,
            "--set",
            "executor.seconds_per_step=2",
            "--set",
            "executor.timeout_s=600",
            "--set",
            "diloco.rounds=100",
        ],
        {},
        [
            "executor.timeout_s (600 s) is shorter than the work one replica is configured for",
            "= 900 s",
            "fix: --set executor.timeout_s=1350",
        ],
    ),
    (
        "unreachable store",
        ["launch", "{cfg}", "--set", f"store={S3}"],
        {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"},
        ["cannot write to store s3://bucket/runs", "Could not connect to the endpoint URL"],
    ),
    (
        "store endpoint on loopback for cloud replicas",
        ["launch", "{cfg}", *HF_UNFLAGGED],
        {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000"},
        [
            "AWS_ENDPOINT_URL_S3=http://127.0.0.1:9000 points the replicas at loopback (127.0.0.1), which HF "
            "Jobs replicas cannot reach",
            "--set executor.private_store_endpoint=true",
        ],
    ),
    (
        "store endpoint on a private network for cloud replicas",
        ["launch", "{cfg}", "--executor", "modal", "--set", f"store={S3}"],
        {"AWS_ENDPOINT_URL": "https://10.20.30.40:9000"},
        ["AWS_ENDPOINT_URL=https://10.20.30.40:9000 points the replicas at a private address (10.20.30.40)"],
    ),
    (
        "local store with a cloud executor",
        ["launch", "{cfg}", "--executor", "hf_jobs"],
        {},
        [
            "is on this machine, but HF Jobs replicas run elsewhere and could not reach it",
            "--set store=s3://",
        ],
    ),
    (
        "stock image without the package",
        ["launch", "{cfg}", "--executor", "hf_jobs", "--set", f"store={S3}", *PRIVATE_OK],
        {},
        [
            "does not contain composer-serverless, and executor.package is not set",
            "deploy/hf_jobs/Dockerfile",
        ],
    ),
    (
        "in-memory store for subprocess replicas",
        ["launch", "{cfg}", "--set", "store=memory://runs"],
        {},
        ["lives in one process's memory; replica subprocesses cannot see it"],
    ),
    (
        "store that cannot hold a run",
        ["launch", "{cfg}", "--set", "store=ftp://example.com/runs"],
        {},
        ["ftp:// cannot hold a run", "fix: set store to a directory or an object store"],
    ),
    ("unknown executor", ["launch", "{cfg}", "--executor", "nope"], {}, ["Invalid value for '--executor'"]),
    ("malformed run URL", ["status", "s3:/bucket/runs/x"], {}, ["'s3:/bucket/runs/x' is a malformed URL"]),
    (
        "URL that is not a run",
        ["logs", "{tmp}/nowhere", "--rank", "0"],
        {},
        ["is not a run: there is no run.json there"],
    ),
    ("export of something that is not a run", ["export", "{tmp}/nowhere", "{tmp}/out"], {}, ["is not a run"]),
    (
        "malformed sweep grid",
        ["sweep", "{cfg}", "--grid", "diloco.outer_lr"],
        {},
        ["--grid 'diloco.outer_lr': expected key=value1,value2"],
    ),
    (
        "bad value in one sweep cell",
        ["sweep", "{cfg}", "--grid", "diloco.outer_lr=0.5,-1"],
        {},
        ["grid cell 1 (diloco.outer_lr=-1)", "diloco.outer_lr: Input should be greater than 0"],
    ),
    (
        "sweep with a push at the end",
        ["sweep", "{cfg}", "--grid", "seed=0,1", "--set", "output.push_to_hub=me/model"],
        {},
        ["a sweep does not push its cells", "export RUN OUT --push-to-hub REPO"],
    ),
]


@pytest.fixture
def launched(monkeypatch):
    """Every executor's launch, recorded instead of run."""
    calls = []
    for executor in (LocalProcessExecutor, HFJobsExecutor, ModalExecutor):
        monkeypatch.setattr(executor, "launch", lambda self, plan, _name=executor.name: calls.append(_name))
    return calls


@pytest.fixture
def user_env(monkeypatch, tmp_path, s3_store):
    """A user who has every credential; each case then takes away what it is about."""
    import huggingface_hub.constants
    import modal.config

    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    monkeypatch.setattr(modal.config, "_user_config", {})  # ignore a developer's ~/.modal.toml
    return s3_store[1]


@pytest.mark.parametrize(("case", "args", "env", "expected"), CASES, ids=[c[0] for c in CASES])
def test_wrong_input_exits_2_with_a_clear_message_and_launches_nothing(
    case, args, env, expected, tmp_path, monkeypatch, user_env, launched
):
    store = tmp_path / "store"
    cfg = write_config(
        tmp_path / "run.toml",
        f"""
        store = "{store}"
        [diloco]
        replicas = 2
        sync_every = 3
        rounds = 2
        """,
    )
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    argv = [a.format(cfg=cfg, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(app, argv)
    output = " ".join(result.output.split())  # undo the console's line wrapping
    assert result.exit_code == 2, result.output
    for fragment in expected:
        assert fragment in output, f"{case}: {fragment!r} not in:\n{result.output}"
    assert not launched
    assert not store.exists() and not (tmp_path / "out").exists()
    assert store_objects(user_env) == {}

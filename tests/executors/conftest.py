"""Fixtures for the executor tests: an S3 server (moto) and a fake HF Jobs API, both on loopback.

The HF Jobs client reads ``HF_ENDPOINT`` when ``huggingface_hub`` is imported, and other tests in this
process import it long before, so everything that talks to the fake runs in a subprocess (the real CLI)
whose environment points at the fake from the start, with telemetry and update checks off and a private
``HF_HOME``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from tests.executors.fake_hf_jobs import FakeHFJobs

REPO = Path(__file__).resolve().parents[2]
HF_TOKEN = "hf_fake_token_0123456789abcdef"
# A known secret value: tests scan everything the run leaves behind and must never find it.
SECRET_ACCESS_KEY = "fake-secret-DO-NOT-LEAK-8e2c41f07a"
NAMESPACE = "tester"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
TINY_TOML = """
[model.tiny]
vocab_size = 400
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 4
tokenizer_corpus_mb = 0.3

[data]
seq_len = 32
batch_size = 4

[train]
lr = 1e-2

[eval]
sequences = 8
"""


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto S3 server per session; its endpoint and fake credentials in the environment for everyone."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(S3_ENV)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    yield endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_store(moto_endpoint):
    """A fresh bucket: the store URL ``s3://bucket/runs`` and a boto3 client to inspect it."""
    import boto3

    urllib.request.urlopen(urllib.request.Request(moto_endpoint + "/moto-api/reset", method="POST")).read()
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket="bucket")
    return "s3://bucket/runs", client


@pytest.fixture(scope="session")
def fake_hf_session(tmp_path_factory):
    home = tmp_path_factory.mktemp("job-home")
    image_env = {
        # The "image": this interpreter's python on PATH, the package importable, one thread per replica.
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    fake = FakeHFJobs(HF_TOKEN, NAMESPACE, image_env).start()
    yield fake
    fake.stop()


@pytest.fixture
def fake_hf(fake_hf_session, tmp_path_factory):
    """The fake, its jobs given a temporary directory of their own (``TMPDIR``), as a container has."""
    fake_hf_session.reset()
    fake_hf_session.image_env["TMPDIR"] = str(tmp_path_factory.mktemp("job-tmp"))
    yield fake_hf_session
    fake_hf_session.kill_all()


@pytest.fixture
def hf_env(fake_hf, moto_endpoint, tmp_path):
    """The environment of a user's shell pointed at the fakes: Hub endpoint, token, S3 endpoint and keys."""
    return {
        **os.environ,
        "HF_ENDPOINT": fake_hf.url,
        "HF_TOKEN": HF_TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "200",
    }


def write_config(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body) + TINY_TOML)
    return path


def cli(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real ``composer-serverless`` CLI in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "composer_serverless.cli", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
    )


def cli_background(
    *args: str, env: dict[str, str], module: str = "composer_serverless.cli"
) -> subprocess.Popen[str]:
    """The CLI (or another ``module`` run with ``python -m``) in its own session (so Ctrl-C reaches it
    alone), stdin open for the cancel/detach prompt.

    Its SIGINT is reset to the default first: a shell starts background jobs with SIGINT ignored, which a
    child inherits (and Python then never raises KeyboardInterrupt), so ``make test &`` would fail the
    Ctrl-C tests for a reason that has nothing to do with the launcher.
    """
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def read_until(process: subprocess.Popen[str], text: str) -> str:
    """What ``process`` (started by ``cli_background``) prints up to the first line containing ``text``, as it
    prints it; fails with its output if it exits first."""
    assert process.stdout is not None
    seen = []
    while line := process.stdout.readline():
        seen.append(line)
        if text in line:
            return "".join(seen)
    out, err = process.communicate()
    raise AssertionError(
        f"exited ({process.returncode}) before printing {text!r}:\n{''.join(seen)}{out}{err}"
    )


def store_objects(client, bucket: str = "bucket") -> dict[str, bytes]:
    """Every object in the bucket, by key."""
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    return {key: client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}

"""Fixtures shared across test packages.

``s3_endpoint``/``s3_url``: a real S3 server on loopback (moto's ``ThreadedMotoServer``), one per session and
wiped before each test that asks for it, reached through s3fs and boto3 exactly as in production. The
endpoint is given through ``AWS_ENDPOINT_URL_S3`` with fake credentials, so replica subprocesses started by
a test inherit it and the code under test carries no test-only arguments.
"""

from __future__ import annotations

import logging
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

S3_BUCKET = "composer-serverless-tests"
_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never fall back to the instance-metadata endpoint, an off-loopback address.
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server on 127.0.0.1 (a random port), set as ``AWS_ENDPOINT_URL_S3`` for the session."""
    from moto.server import ThreadedMotoServer

    patch = pytest.MonkeyPatch()
    for name, value in _S3_ENV.items():
        patch.setenv(name, value)
    # werkzeug logs every request even with verbose=False.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    patch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    try:
        yield endpoint
    finally:
        server.stop()
        patch.undo()


@pytest.fixture
def s3_url(s3_endpoint: str) -> str:
    """A fresh ``s3://`` prefix in an empty bucket: the server's state is reset for every test."""
    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")).read()
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=S3_BUCKET)
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}"

"""Fixtures shared across test packages.

``tiny_model_dir``: a tiny Llama and its BPE tokenizer, built once per session with save_pretrained.

``s3_endpoint``/``s3_url``: a real S3 server on loopback (moto's ``ThreadedMotoServer``), one per session and
wiped before each test that asks for it, reached through s3fs and boto3 exactly as in production. The
endpoint is given through ``AWS_ENDPOINT_URL_S3`` with fake credentials (for the test's duration), so
replica subprocesses started by a test inherit it and the code under test carries no test-only arguments.
"""

from __future__ import annotations

import logging
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from composer_serverless.config import TinyModelConfig

# Small enough to build in a few seconds, large enough to be a real Llama with a real BPE vocabulary.
TINY = TinyModelConfig(
    vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, tokenizer_corpus_mb=0.3
)

S3_BUCKET = "composer-serverless-tests"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never fall back to the instance-metadata endpoint, an off-loopback address.
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def corpus():
    from composer_serverless.replicas.data import stdlib_corpus

    return stdlib_corpus(5.0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, corpus):
    """A tiny Llama and its tokenizer, built once per session and saved with save_pretrained."""
    from composer_serverless.models import build_tiny
    from composer_serverless.replicas.data import training_text

    out = tmp_path_factory.mktemp("tiny-model")
    return build_tiny(TINY, training_text(corpus, int(TINY.tokenizer_corpus_mb * 1e6), seed=0), out, seed=0)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server on 127.0.0.1 (a random port), one per session."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request even with verbose=False.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``s3://`` prefix in an empty bucket: the server's state is reset for every test.

    The endpoint and fake credentials are set in the environment for this test only, so other test packages
    with S3 servers of their own are not redirected to this one.
    """
    import boto3

    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL_S3": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")).read()
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=S3_BUCKET)
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}"

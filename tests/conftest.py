"""Fixtures shared across test packages.

``tiny_model_dir``: a tiny Llama and its BPE tokenizer, built once per session with save_pretrained.

``s3_endpoint``/``s3_url``: a real S3 server on loopback (moto's ``ThreadedMotoServer``), one per session and
wiped before each test that asks for it, reached through s3fs and boto3 exactly as in production. The
endpoint is given through ``AWS_ENDPOINT_URL_S3`` with fake credentials (for the test's duration), so
replica subprocesses started by a test inherit it and the code under test carries no test-only arguments.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from composer_serverless.accelerator import SIMULATED_ENV
from composer_serverless.config import TinyModelConfig

# trackio reads its directory once, when imported: the tests' tracker runs (and their CLI subprocesses') go to
# a directory of their own, never the user's.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="composer-serverless-trackio-"))

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
    from composer_serverless.data.corpus import stdlib_corpus

    return stdlib_corpus(5.0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, corpus):
    """A tiny Llama and its tokenizer, built once per session and saved with save_pretrained."""
    from composer_serverless.data.corpus import training_text
    from composer_serverless.models.loading import build_tiny

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


# The training stack: what the launcher's side (dry runs, status, cancel) must do without.
TRAINING_STACK = ("torch", "torchft", "transformers")
_CLI_THEN_LIST_MODULES = """
import json, sys
exec(sys.argv.pop(1))
from composer_serverless.cli import run
code = run(sys.argv[2:])
print("LOADED " + json.dumps(sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(sys.argv[1])))))
sys.exit(code)
"""


def cli_in_fresh_process(*argv: str, before: str = "") -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the CLI with ``argv`` in a new interpreter (after the code ``before``): its result, and which of
    ``TRAINING_STACK`` it loaded."""
    result = subprocess.run(
        [sys.executable, "-c", _CLI_THEN_LIST_MODULES, before, json.dumps(TRAINING_STACK), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    marker = [line for line in result.stdout.splitlines() if line.startswith("LOADED ")]
    assert marker, result.stdout + result.stderr
    return result, json.loads(marker[-1].removeprefix("LOADED "))


# How a replica process is started: the worker module (every executor), the tests' replica twin, or the CLI
# launching a run (which then starts the worker itself).
_REPLICA_COMMANDS = ("composer_serverless.replicas.worker", "replica_process.py", "analytic_replica.py")


def _starts_replicas(args: object) -> bool:
    argv = [args] if isinstance(args, (str, bytes)) else list(args)  # type: ignore[call-overload]
    text = " ".join(map(str, argv))
    via_cli = "composer_serverless" in text and any(a in ("launch", "sweep") for a in map(str, argv))
    return any(command in text for command in _REPLICA_COMMANDS) or (via_cli and "--dry-run" not in text)


@pytest.fixture(autouse=True)
def _replica_processes_only_in_slow_tests(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A test that starts replica processes must carry the ``slow`` marker (``make test`` runs them all;
    ``pytest -m "not slow"`` is the quick loop): held by this check, not by memory. Those a slow test
    started and left running (it failed before it waited for them: a syncer waiting for learners that were
    never restarted runs forever) are killed when it ends."""
    slow = request.node.get_closest_marker("slow") is not None
    popen_init = subprocess.Popen.__init__
    started: list[subprocess.Popen] = []

    def checked(self: subprocess.Popen, args: object, *rest: object, **options: object) -> None:
        replica = _starts_replicas(args)
        if replica and not slow:
            raise AssertionError(f"{request.node.nodeid} starts replica processes ({args!r}); mark it slow")
        popen_init(self, args, *rest, **options)  # type: ignore[arg-type]
        if replica:
            started.append(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked)
    yield
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A ChatML template without {% generation %} markers (as most published ones), and one with them.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A tool-calling chat template in the Hermes/Qwen2.5 style (the <tool_call> format environments/parsing.py
# reads), shortened: the tools' schemas in <tools></tools> in the system turn, the model's calls as <tool_call>
# JSON, the tools' answers in <tool_response></tool_response> of a user turn. The suite's episodes run on it:
# the model check refuses a template that renders neither tools nor tool turns.
TOOL_CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}\n<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with a ChatML chat template on its tokenizer, as a chat model is published."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-chat-model")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(out)
    return out


def arithmetic_chats(count: int, seed: int) -> list[dict]:
    """Conversations a tiny model can learn in a few steps: a question, then its answer."""
    import random

    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        chats.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer with the number only."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    return chats


# What a replica on the simulated accelerator logs first: a test that means to run there checks its logs for it.
SIMULATED_LOG_LINE = "running on a simulated accelerator"


@contextmanager
def replicas_on_the_simulated_accelerator() -> Iterator[None]:
    """Replica processes started in this block take their CUDA path, on the simulated accelerator
    (``accelerator/simulated.py``): CUDA's placement rules, on this CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SIMULATED_ENV, "1")
        yield


def ran_on_the_simulated_accelerator(logs: Path) -> bool:
    """Whether every replica log under ``logs`` says its process ran on the simulated accelerator."""
    texts = [p.read_text() for p in sorted(logs.glob("*.log"))]
    return bool(texts) and all(SIMULATED_LOG_LINE in t for t in texts)


@pytest.fixture(scope="session")
def tool_chat_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with a tool-calling chat template (``TOOL_CHATML``), as a tool-calling model is published."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-tool-chat-model")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TOOL_CHATML
    tokenizer.save_pretrained(out)
    return out

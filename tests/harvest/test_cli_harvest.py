"""`composer-serverless harvest` end to end in a fresh interpreter: the dry run's plan and estimate (nothing
sent, no training stack loaded), the harvest's table and pairs, a second run answered by the cache, the
mistakes that exit 2, and a canary key found nowhere: not in the output, the logs, the plan, the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from composer_serverless.data.records import read_pairs
from tests.conftest import cli_in_fresh_process
from tests.harvest.conftest import CANARY
from tests.harvest.fake_teacher import answers

TRACE = [
    {"prompt": "add 2 3=", "student": "6", "task": "add", "teachers": {"offline": "5"}},
    {"prompt": "first 123=", "student": "1"},
    {"prompt": "max 191=", "student": "1", "id": "state-7"},
]
ANSWERS = [
    {"add 2 3=": "The answer is 5.", "first 123=": "answer is 1", "max 191=": "the answer is 9"},
    {"add 2 3=": "answer is 5", "first 123=": "answer is 2", "max 191=": "answer is 9"},
    {"add 2 3=": "answer is 4", "first 123=": "answer is 1", "max 191=": "no idea"},
]


def _write(tmp_path: Path, fakes, **extra: str) -> Path:
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    teachers = "".join(
        f"""
        [[harvest.teachers]]
        name = "t{i}"
        base_url = "{fake.base_url}"
        model = "m{i}"
        api_key_env = "TEACHER_KEY"
        usd_per_m_input = 2.0
        usd_per_m_output = 8.0
        max_tokens = 32
        """
        for i, fake in enumerate(fakes)
    )
    settings = "".join(f"{k} = {v}\n" for k, v in {"max_usd": "1.0", **extra}.items())
    config = tmp_path / "harvest.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [harvest]
            traces = "{tmp_path / "trace.jsonl"}"
            output = "{tmp_path / "out" / "pairs.jsonl"}"
            cache = "{tmp_path / "cache"}"
            normalise = {{ final_answer = 'answer is\\s*(\\S+)', trim_chars = "." }}
            {settings}
            """
        )
        + textwrap.dedent(teachers)
    )
    return config


def _cli(*argv: str, key: str | None = CANARY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TEACHER_KEY"}
    if key is not None:
        env["TEACHER_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "composer_serverless.cli", "-v", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _plan(stdout: str) -> dict:
    return json.loads(stdout.rsplit("LOADED ", 1)[0])  # cli_in_fresh_process's last line lists the modules


@pytest.fixture
def fakes(teachers):
    return teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)


def test_dry_run_then_harvest_then_the_cache_and_no_key_anywhere(fakes, tmp_path, monkeypatch):
    for fake, table in zip(fakes, ANSWERS, strict=True):
        fake.script = answers(table)
    config = _write(tmp_path, fakes)

    monkeypatch.setenv("TEACHER_KEY", CANARY)  # the dry run has the key to hand, and must not show it
    dry, loaded = cli_in_fresh_process("harvest", str(config), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert loaded == [] and not any(f.seen for f in fakes)
    plan = _plan(dry.stdout)
    assert (plan["states"], plan["prompts"], plan["max_usd"]) == (3, 3, 1.0)
    assert [t["api_key_env"] for t in plan["teachers"]] == ["TEACHER_KEY"] * 3
    assert plan["worst_usd"] > plan["expected_usd"] > 0
    assert (plan["missing_keys"], plan["unusable_keys"]) == ([], [])
    assert "estimated cost: expected $" in dry.stderr and "export TEACHER_KEY" not in dry.stderr

    first = _cli("harvest", str(config), key=CANARY + "\r\n")  # as a .env file saved with CRLF gives it
    assert first.returncode == 0, first.stdout + first.stderr
    assert "pairs produced: 2" in first.stdout and "saved by the cache $0.00" in first.stdout
    pairs = read_pairs(str(tmp_path / "out" / "pairs.jsonl"))  # the replay channel's own reader
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("add 2 3=", "5", "6"),
        ("max 191=", "9", "1"),
    ]
    written = [json.loads(line) for line in (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()]
    assert written[1]["provenance"]["states"] == ["state-7"]
    assert written[0]["provenance"]["agreement"] == {
        "votes": 2,
        "voters": ["t0", "t1"],
        "answered": 3,
        "teachers": 3,
        "threshold": 2,
    }
    sent = sum(len(f.seen) for f in fakes)
    assert sent == 9

    again = _cli("harvest", str(config))
    assert again.returncode == 0 and sum(len(f.seen) for f in fakes) == sent
    assert "spent $0.00 of the $1.00 cap" in again.stdout and "pairs produced: 2" in again.stdout
    monkeypatch.delenv("TEACHER_KEY")
    dry_again, _ = cli_in_fresh_process("harvest", str(config), "--dry-run")
    assert _plan(dry_again.stdout)["worst_usd"] == 0  # everything is cached
    assert _plan(dry_again.stdout)["missing_keys"] == ["TEACHER_KEY"]
    assert "export TEACHER_KEY=..." in dry_again.stderr  # a dry run says what a harvest would lack

    haystacks = {"dry run": dry.stdout + dry.stderr, "harvest": first.stdout + first.stderr}
    haystacks |= {"again": again.stdout + again.stderr, "dry again": dry_again.stdout + dry_again.stderr}
    haystacks |= {str(p): p.read_bytes().decode() for p in tmp_path.rglob("*") if p.is_file()}
    assert len([k for k in haystacks if "/cache/" in k]) == 9
    assert all(s.authorized for f in fakes for s in f.seen)
    leaks = [where for where, text in haystacks.items() if CANARY in text]
    assert not leaks, f"the key was found in {leaks}"


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        ({}, None, "the teachers' keys are not in the environment: TEACHER_KEY"),
        ({"threshold": "4"}, CANARY, "threshold (4) exceeds the 3 teachers"),
        ({"max_usd": "0"}, CANARY, "harvest.max_usd: Input should be greater than 0"),
        ({"live": "true"}, CANARY, "harvest.live"),
        ({"teachres": "[]"}, CANARY, "did you mean harvest.teachers?"),
        ({}, CANARY[:12] + " " + CANARY[12:], "the key in TEACHER_KEY holds a character an HTTP header"),
    ],
)
def test_mistakes_exit_2_before_anything_is_sent(fakes, tmp_path, extra, key, message):
    config = _write(tmp_path, fakes, **extra)
    result = _cli("harvest", str(config), key=key)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    if "TEACHER_KEY" in message:
        assert "fix: export TEACHER_KEY=..." in result.stderr
    assert CANARY[:12] not in result.stdout + result.stderr
    assert not any(f.seen for f in fakes)
    assert not (tmp_path / "out").exists()


def test_a_key_pasted_as_the_variable_name_is_refused_without_being_repeated(fakes, tmp_path):
    config = _write(tmp_path, fakes)
    config.write_text(config.read_text().replace('api_key_env = "TEACHER_KEY"', f'api_key_env = "{CANARY}"'))
    result = _cli("harvest", str(config))
    assert result.returncode == 2 and "must be the NAME of an environment variable" in result.stderr
    assert CANARY not in result.stdout + result.stderr

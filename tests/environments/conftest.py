"""Fixtures for the episode tests: the character tokenizer over printable ASCII (so tool calls' JSON encodes)
with a ChatML template that renders tool turns, and a scripted "model" that writes given turns."""

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from composer_serverless.environments.episodes import chat_codec
from composer_serverless.models.loading import char_tokenizer
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator

TOOL_CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TOOL_CHATML
    return tokenizer


@pytest.fixture
def codec(tokenizer):
    return chat_codec(tokenizer, [tokenizer.eos_token_id])


class Scripted:
    """``complete`` that writes, for the episode whose prompt a prefix starts with, its next scripted turn
    (and EOS), cut to the budget; counts its calls."""

    def __init__(self, tokenizer, scripts: dict[str, Sequence[str]]) -> None:
        self.tokenizer = tokenizer
        self.prompts = {p: tokenizer(p, add_special_tokens=False)["input_ids"] for p in scripts}
        self.turns = {p: list(turns) for p, turns in scripts.items()}
        self.calls = 0

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.prompts[prompt]

    def __call__(self, prefixes: list[list[int]], budget: int) -> list[list[int]]:
        self.calls += 1
        out = []
        for prefix in prefixes:
            prompt = next(p for p, ids in self.prompts.items() if prefix[: len(ids)] == ids)
            text = self.turns[prompt].pop(0)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(ids[:budget])
        return out


@pytest.fixture
def scripted(tokenizer):
    return lambda scripts: Scripted(tokenizer, scripts)


def trained_rows(config: Path, run_id: str, rounds: int, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Launch the task ``config`` (from its directory, on the simulated accelerator) as a user would; check it
    committed ``rounds`` rounds with its replicas bit-identical; rank 0's step rows of the training rounds."""
    monkeypatch.chdir(config.parent)
    with replicas_on_the_simulated_accelerator():
        assert cli_run(["launch", str(config), "--set", f"run_id={run_id}"]) == 0
    run = config.parent / "runs" / run_id
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_committed"] == rounds and summary["replicas_bit_identical"]
    assert ran_on_the_simulated_accelerator(run / "logs")
    rows = [json.loads(p.read_text()) for p in sorted((run / "metrics" / "0").glob("*.json"))]
    trained = [r["train"] for r in rows if r["round"] > 0]
    assert trained
    return trained

"""The launcher's side needs no training stack: a dry run of either objective, its model and reward checks
included (each in a child process), loads no torch, torchft or transformers (``status`` on finished runs is
checked the same way in the end-to-end tests)."""

from __future__ import annotations

import pytest

from tests.conftest import cli_in_fresh_process


@pytest.mark.parametrize(
    "config",
    [
        "deploy/configs/local-demo.toml",
        "deploy/configs/local-composer.toml",
        "deploy/configs/gsm8k-qwen2.5-0.5b.toml",  # a Hub model and rewards of the user's: both child checks
    ],
)
def test_a_dry_run_loads_no_training_stack(config: str) -> None:
    result, loaded = cli_in_fresh_process("launch", config, "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"executor": "local"' in result.stdout
    assert loaded == []


def test_the_check_sees_the_training_stack_when_it_is_loaded() -> None:
    """A check that could never fail would prove nothing: with torch imported first, it is reported."""
    result, loaded = cli_in_fresh_process("--help", before="import torch")
    assert result.returncode == 0 and loaded == ["torch"]

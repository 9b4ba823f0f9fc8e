"""SIGTERM before the launcher watches a run: a clear message, exit 1, and the default handler restored."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from typer.testing import CliRunner

from composer_serverless import cli, launcher

DEMO = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "local-demo.toml"


def test_sigterm_while_preparing_stops_with_a_message_and_restores_the_handler(monkeypatch) -> None:
    def terminated_while_preparing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, before this returns
        raise AssertionError("SIGTERM should have interrupted prepare()")

    monkeypatch.setattr(launcher, "prepare", terminated_while_preparing)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(cli.app, ["launch", str(DEMO)])
    assert result.exit_code == 1, result.output
    assert "SIGTERM" in result.output and "cancelled" in result.output
    assert signal.getsignal(signal.SIGTERM) == before

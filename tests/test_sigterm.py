"""SIGTERM before the launcher watches a run: a clear message, exit 1, and the default handler restored; the
library's entry points (``launch``, ``resume``, a sweep) install the handler themselves, over the default only."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from composer_serverless import cli
from composer_serverless.config import load_config
from composer_serverless.launch import launcher, sweep
from composer_serverless.launch.supervisor import Terminated

DEMO = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "local-demo.toml"


def _terminated(*args, **kwargs):
    # Without a handler SIGTERM would end pytest itself rather than fail this test.
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "nothing handles SIGTERM here"
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM should have interrupted the call")


def test_sigterm_while_preparing_stops_with_a_message_and_restores_the_handler(monkeypatch) -> None:
    monkeypatch.setattr(launcher, "prepare", _terminated)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(cli.app, ["launch", str(DEMO)])
    assert result.exit_code == 1, result.output
    assert "SIGTERM" in result.output and "cancelled" in result.output
    assert signal.getsignal(signal.SIGTERM) == before


def test_launch_itself_raises_sigterm_as_terminated_and_restores_the_default(monkeypatch) -> None:
    """Without the CLI (a benchmark, a user's script) ``launch`` still turns SIGTERM into ``Terminated``, which
    the watch answers by cancelling the replicas; afterwards SIGTERM does what it did before."""

    monkeypatch.setattr(launcher, "prepare", _terminated)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(Terminated):
        launcher.launch(load_config(DEMO), str(DEMO), Console(file=io.StringIO()))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_resume_and_a_sweep_raise_sigterm_as_terminated(monkeypatch) -> None:
    monkeypatch.setattr(launcher, "open_created", _terminated)
    with pytest.raises(Terminated):
        launcher.resume("file:///nowhere/run", Console(file=io.StringIO()))
    monkeypatch.setattr(sweep, "start", _terminated)
    cell = sweep.Cell(index=0, values={}, prepared=None)  # type: ignore[arg-type]
    with pytest.raises(Terminated):
        sweep.run_sweep([cell], Console(file=io.StringIO()))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_the_caller_set_is_kept(monkeypatch) -> None:
    """A caller with a SIGTERM handler of its own (a scheduler's graceful stop) keeps it during ``launch``."""
    received: list[int] = []

    def prepare_then_fail(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise LookupError("prepare went on after the signal")

    monkeypatch.setattr(launcher, "prepare", prepare_then_fail)

    def theirs(signum: int, frame: object) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, theirs)
    try:
        with pytest.raises(LookupError):
            launcher.launch(load_config(DEMO), str(DEMO), Console(file=io.StringIO()))
        assert received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_cli_handles_sigterm_before_any_launch_starts(monkeypatch) -> None:
    """``--dry-run`` prepares outside ``launch``: the CLI's own handler still turns SIGTERM into the message."""
    monkeypatch.setattr(launcher, "prepare", _terminated)
    result = CliRunner().invoke(cli.app, ["launch", str(DEMO), "--dry-run"])
    assert result.exit_code == 1 and "SIGTERM" in result.output, result.output
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

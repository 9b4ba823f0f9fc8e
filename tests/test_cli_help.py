"""The command line's own surface: every word of every help text shown at 80 columns, flags shown as flags,
``--version``, and ``-v`` before or after the command."""

from __future__ import annotations

import inspect
import logging
import re
from importlib import metadata

import pytest
import typer
from typer.testing import CliRunner

from composer_serverless.cli import app

GROUP = typer.main.get_command(app)  # a click group (Typer's own copy of click)
COMMANDS = sorted(GROUP.commands)


def _help(argv: list[str]) -> str:
    """``argv --help`` as an 80-column terminal shows it, whatever the terminal running the tests."""
    result = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def _texts(command) -> list[str]:
    """The help texts a command's help shows: its docstring (up to a form feed) and each parameter's."""
    texts = [inspect.cleandoc(command.help or "").partition("\f")[0]]
    return texts + [p.help for p in command.params if getattr(p, "help", None)]


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_every_word_of_a_help_text_is_shown_in_order_at_80_columns(name: str) -> None:
    command = GROUP.commands[name] if name else GROUP
    shown = _help([name] if name else [])
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    words = " ".join(shown.split())  # the lines as one: a help text may wrap anywhere between words
    for text in _texts(command):
        assert " ".join(text.split()) in words, (
            f"{name or 'the top level'}: {text!r} not shown whole:\n{shown}"
        )


def test_the_bracketed_words_are_among_those_checked() -> None:
    """Rich markup took "[tracking]" and the like for tags and dropped them: the help texts hold such words."""
    bracketed = {
        word
        for command in [GROUP, *GROUP.commands.values()]
        for text in _texts(command)
        for word in re.findall(r"\[\w+\]", text)
    }
    assert {"[tracking]", "[output]", "[harvest]", "[executor]"} <= bracketed
    assert "[harvest]" in _help(["harvest"]) and "[tracking], [output]" in " ".join(_help(["launch"]).split())


@pytest.mark.parametrize("name", COMMANDS)
def test_a_flag_is_shown_without_a_value(name: str) -> None:
    shown = _help([name])
    flags = [opt for p in GROUP.commands[name].params if getattr(p, "is_flag", False) for opt in p.opts]
    assert "--verbose" in flags and "--help" in shown
    for flag in [*flags, "--help"]:
        line = next(line for line in shown.splitlines() if re.search(rf"(^|\s|,){re.escape(flag)}\b", line))
        assert re.search(rf"{re.escape(flag)}(\s{{2,}}|$|\s/\s|,)", line), line
    assert "<bool>" not in shown


def test_version_prints_the_installed_distributions_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"composer-serverless {metadata.version('composer-serverless')}\n"


def test_version_from_a_source_tree_that_is_not_installed_says_how_to_install_it(monkeypatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()) == (
        "error: composer-serverless is imported from a source tree but not installed, so it has no version "
        "fix: pip install -e . in the source tree"
    )


@pytest.fixture
def root_level():
    """The root logger's level, put back after the test (``-v`` raises it for the whole process)."""
    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(saved)


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "status", "{run}"],
        ["status", "{run}", "-v"],
        ["status", "--verbose", "{run}"],
        ["logs", "{run}", "--rank", "0", "-v"],
        ["export", "{run}", "{run}-out", "-v"],
    ],
    ids=["before", "after", "between", "logs", "export"],
)
def test_verbose_before_or_after_the_command_logs_at_info(argv, root_level, tmp_path) -> None:
    run = str(tmp_path / "no-run")
    result = CliRunner().invoke(app, [a.format(run=run) for a in argv])
    assert result.exit_code == 2, result.output  # not a run: the options were read all the same
    assert logging.getLogger("composer_serverless").isEnabledFor(logging.INFO)


def test_without_verbose_info_is_not_logged(root_level, tmp_path) -> None:
    result = CliRunner().invoke(app, ["status", str(tmp_path / "no-run")])
    assert result.exit_code == 2, result.output
    assert not logging.getLogger("composer_serverless").isEnabledFor(logging.INFO)

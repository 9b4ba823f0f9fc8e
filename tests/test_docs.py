"""docs/architecture.md stays true to the code: its store layout is ``layout.describe()`` and its layers are
the contract ``lint-imports`` holds."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from composer_serverless.rendezvous import layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _code_block_after(heading: str) -> list[str]:
    section = ARCHITECTURE[ARCHITECTURE.index(heading) :]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None, f"no code block under {heading!r}"
    return block.group(1).splitlines()


def test_the_store_layout_table_is_the_layout_module() -> None:
    rows = []
    for line in _code_block_after("## The store layout"):
        key, meaning = re.split(r"\s{2,}", line.removeprefix("{store}/{run_id}/"), maxsplit=1)
        rows.append((key, meaning))
    assert rows == layout.describe()


def test_the_layers_are_the_import_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("containers") == ["composer_serverless"]]
    assert _code_block_after("## Layers") == layers


def test_the_table_of_wrong_inputs_is_the_wrong_inputs_test() -> None:
    """docs/executors.md lists every wrong input the test checks, in its order, each with what it says."""
    from tests.executors.test_wrong_inputs import CASES

    executors = (ROOT / "docs" / "executors.md").read_text()
    table = executors[
        executors.index("| wrong input | exit |") : executors.index("What a backend's API answers")
    ]
    rows = [line.split(" | ") for line in table.splitlines()[2:] if line.startswith("| ")]
    assert [row[0].removeprefix("| ") for row in rows] == [case[0] for case in CASES]
    for row, (name, _, _, expected) in zip(rows, CASES, strict=True):
        assert row[1] == "2" and expected[0] in row[2], name

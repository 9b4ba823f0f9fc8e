"""A grid of runs: every combination of ``--grid key=v1,v2`` values is its own run, launched together.

Each cell is a complete run (its own run id ``<base>-c<i>``, store prefix, replicas and report), so a cell
can be inspected, resumed or exported like any other run. Every cell's config and plan is validated, and
this machine's setup checked, before the first cell is created: a typo in the third value costs nothing.
Cells run side by side (on a cloud backend that is the point of a sweep); one failing cell does not stop
the others. The result is a table: the grid values, the state, rounds committed and the final held-out loss.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from composer_serverless.config import RUN_ID_PATTERN, ConfigError, load_config
from composer_serverless.launch import watch
from composer_serverless.launch.launcher import Prepared, new_run_id, prepare, start
from composer_serverless.launch.supervisor import sigterm_cancels
from composer_serverless.launch.watch import Choice, Followed, RunView, cancel_on_interrupt


@dataclass
class Cell:
    """One point of the grid: its values, its prepared run, and that run once started."""

    index: int
    values: dict[str, str]
    prepared: Prepared
    run: Followed | None = None

    @property
    def label(self) -> str:
        return f"cell {self.index}"

    @property
    def state(self) -> str:
        return "pending" if self.run is None else self.run.state

    @property
    def summary(self) -> dict[str, Any] | None:
        return None if self.run is None else self.run.summary


def parse_grid(grid: list[str]) -> list[tuple[str, list[str]]]:
    """``["a.b=1,2", "c=x"]`` -> ``[("a.b", ["1", "2"]), ("c", ["x"])]``; ConfigError when malformed."""
    axes = []
    for item in grid:
        key, sep, values = item.partition("=")
        parts = [v.strip() for v in values.split(",")]
        if not sep or not key.strip() or not all(parts):
            raise ConfigError(
                f"--grid {item!r}: expected key=value1,value2,..., e.g. --grid diloco.outer_lr=0.5,0.7"
            )
        axes.append((key.strip(), parts))
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise ConfigError(
            f"--grid names a key twice: {keys}\n  fix: one --grid per key, values comma-separated"
        )
    return axes


def plan_sweep(
    path: Path, grid: list[str], overrides: list[str], executor_type: str | None, dry_run: bool = False
) -> list[Cell]:
    """Validate, check and plan every cell; raises ConfigError (naming the cell) before anything is created.
    A ``dry_run`` checks the model offline (``launcher.prepare``) and leaves what this machine lacks in the
    cells' ``problems`` to be shown, where a sweep refuses it."""
    axes = parse_grid(grid)
    combos = [
        dict(zip([k for k, _ in axes], values, strict=True))
        for values in itertools.product(*(v for _, v in axes))
    ]
    cells = []
    base = None
    for index, values in enumerate(combos):
        cell_overrides = [*overrides, *(f"{k}={v}" for k, v in values.items())]
        try:
            config = load_config(path, cell_overrides, executor_type)
        except ConfigError as e:
            raise ConfigError(f"grid cell {index} ({describe(values)}): {e}") from None
        if config.output.push_to_hub is not None:
            raise ConfigError(
                f"output.push_to_hub = {config.output.push_to_hub!r}: a sweep does not push its cells (they would "
                "all push to one repo)\n  fix: remove [output] push_to_hub, then push the cell you choose with "
                "`composer-serverless export RUN OUT --push-to-hub REPO`"
            )
        base = base or config.run_id or new_run_id(str(path))
        run_id = f"{base[: 63 - len(f'-c{index}')]}-c{index}"
        assert RUN_ID_PATTERN.match(run_id), run_id
        try:
            prepared = prepare(config.model_copy(update={"run_id": run_id}), str(path), offline=dry_run)
        except ConfigError as e:
            raise ConfigError(f"grid cell {index} ({describe(values)}): {e}") from None
        cells.append(Cell(index, values, prepared))
    missing = problems(cells)
    if missing and not dry_run:
        raise ConfigError("cannot launch the sweep:\n" + "\n".join(textwrap.indent(p, "  ") for p in missing))
    return cells


def problems(cells: list[Cell]) -> list[str]:
    """What this machine lacks for any cell, each once."""
    return sorted({p for cell in cells for p in cell.prepared.problems})


@sigterm_cancels()
def run_sweep(
    cells: list[Cell], console: Console, on_interrupt: Callable[[], Choice] = cancel_on_interrupt
) -> list[Cell] | None:
    """Start every cell, watch them all to the end, write each finished cell's report; None if detached.

    A cell that fails is cancelled and marked; the others go on.
    """
    runs: list[Followed] = []
    try:
        for cell in cells:
            supervisor = start(cell.prepared, console)
            cell.run = Followed(supervisor, cell.prepared.config, label=f"{cell.label}: ")
            runs.append(cell.run)
            console.print(
                f"{cell.label} ({describe(cell.values)}): run {cell.prepared.plan.run_id} at {supervisor.run.url}",
                markup=False,
            )
            if supervisor.held_interrupt is not None:  # Ctrl-C while it started: ask before starting more
                break
    except BaseException:
        for run in runs:  # the cells started so far must not keep running
            run.supervisor.executor.cancel_run(run.supervisor.record)
        raise
    if not watch.follow(runs, RunView(runs, console), on_interrupt, fail_fast=False):
        return None
    watch.write_reports(runs)
    return cells


def results_table(cells: list[Cell]) -> Table:
    keys = list(cells[0].values) if cells else []
    what = "reward" if cells and cells[0].prepared.config.train.objective == "composer" else "loss"
    table = Table(title="sweep results")
    # The run id, not its URL: a URL folded at the terminal's width could not be copied; the URLs are
    # printed whole when the cells start, and ``runs_root`` says where the ids live.
    for column in ["cell", *keys, "state", "rounds", f"final held-out {what}", "run"]:
        table.add_column(column, no_wrap=True)
    for cell in cells:
        summary = cell.summary or {}
        final = summary.get(f"final_eval_{what}")
        rounds = f"{summary['rounds_committed']}/{summary['rounds']}" if summary else "-"
        table.add_row(
            str(cell.index),
            *(cell.values[k] for k in keys),
            cell.state,
            rounds,
            "-" if final is None else f"{final:.4f}",
            cell.prepared.plan.run_id,
        )
    return table


def runs_root(cells: list[Cell]) -> str:
    """The store the cells' runs live in: ``<root>/<run id>`` is a run's URL."""
    return cells[0].prepared.config.store


def describe(values: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from composer_serverless.config import RUN_ID_PATTERN, ConfigError, load_config
from composer_serverless.launcher import (
    HEARTBEAT_POLL_S,
    Choice,
    Prepared,
    cancel_on_interrupt,
    new_run_id,
    prepare,
    print_detached,
    start,
    status_poll_s,
)
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.report import write_report
from composer_serverless.supervisor import RunCancelled, RunFailed, Supervisor, Terminated


@dataclass
class Cell:
    """One point of the grid and what became of its run."""

    index: int
    values: dict[str, str]
    prepared: Prepared
    supervisor: Supervisor | None = None
    state: str = "pending"
    detail: str = ""
    summary: dict[str, Any] | None = None
    next_status: float = 0.0


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


def plan_sweep(path: Path, grid: list[str], overrides: list[str], executor_type: str | None) -> list[Cell]:
    """Validate and plan every cell; raises ConfigError (naming the cell) before anything is created."""
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
            raise ConfigError(f"grid cell {index} ({_describe(values)}): {e}") from None
        base = base or config.run_id or new_run_id(str(path))
        run_id = f"{base[: 63 - len(f'-c{index}')]}-c{index}"
        assert RUN_ID_PATTERN.match(run_id), run_id
        cells.append(Cell(index, values, prepare(config.model_copy(update={"run_id": run_id}), str(path))))
    problems = sorted({p for cell in cells for p in cell.prepared.problems})
    if problems:
        raise ConfigError(
            "cannot launch the sweep:\n" + "\n".join(textwrap.indent(p, "  ") for p in problems)
        )
    return cells


def run_sweep(
    cells: list[Cell], console: Console, on_interrupt: Callable[[], Choice] = cancel_on_interrupt
) -> list[Cell] | None:
    """Start every cell, watch them all to the end, write each finished cell's report; None if detached."""
    started = time.monotonic()
    try:
        for cell in cells:
            cell.supervisor = start(cell.prepared, console)
            cell.state = "running"
            plan = cell.prepared.plan
            console.print(
                f"cell {cell.index} ({_describe(cell.values)}): "
                f"run {plan.run_id} at {cell.supervisor.run.url}",
                markup=False,
            )
        _watch(cells, console)
    except KeyboardInterrupt:
        if on_interrupt() == "detach":
            for cell in cells:
                if cell.supervisor is not None:
                    print_detached(cell.supervisor.run.url, console)
            return None
        for cell in _live(cells):
            cell.supervisor.cancel()
        raise RunCancelled("sweep cancelled at your request") from None
    except Terminated:
        for cell in _live(cells):
            cell.supervisor.cancel()
        raise RunCancelled(Terminated.message) from None
    except BaseException:
        for cell in _live(cells):
            cell.supervisor.executor.cancel(cell.supervisor.handles)
        raise
    for cell in cells:
        if cell.state == "succeeded" and cell.supervisor is not None:
            cell.summary = write_report(cell.supervisor.run, cell.prepared.config, time.monotonic() - started)
    return cells


def _live(cells: list[Cell]) -> list[Any]:
    return [c for c in cells if c.supervisor is not None and c.state == "running"]


def _watch(cells: list[Cell], console: Console) -> None:
    progress = Progress(
        TextColumn("cell {task.fields[cell]}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[state]}"),
        console=console,
    )
    tasks = {}
    for cell in cells:
        dl = cell.prepared.config.diloco
        total = dl.replicas * dl.rounds * dl.sync_every
        tasks[cell.index] = progress.add_task("", total=total, cell=cell.index, state=cell.state)
    with progress:
        while _live(cells):
            for cell in _live(cells):
                _poll(cell, progress.console)
                beats = read_heartbeats(cell.supervisor.run)
                dl = cell.prepared.config.diloco
                done = sum(
                    max(0, b.get("round", 1) - 1) * dl.sync_every + b.get("step", 0) for b in beats.values()
                )
                progress.update(tasks[cell.index], completed=done, state=cell.state)
            time.sleep(HEARTBEAT_POLL_S)
        for cell in cells:
            progress.update(tasks[cell.index], state=cell.state)


def _poll(cell: Cell, console: Console) -> None:
    if time.monotonic() < cell.next_status:
        return
    cell.next_status = time.monotonic() + status_poll_s(cell.prepared.config)
    supervisor = cell.supervisor
    try:
        poll = supervisor.poll()
    except RunFailed as e:
        supervisor.executor.cancel(supervisor.handles)
        cell.state, cell.detail = "failed", str(e)
        console.print(f"[red]cell {cell.index} failed:[/] {escape(str(e))}", highlight=False)
        return
    except RunCancelled as e:
        cell.state, cell.detail = "cancelled", str(e)
        return
    for event in poll.events:
        console.print(f"[yellow]cell {cell.index}: {escape(event)}[/]", highlight=False)
    if poll.finished:
        cell.state = "succeeded"


def results_table(cells: list[Cell]) -> Table:
    keys = list(cells[0].values) if cells else []
    table = Table(title="sweep results")
    # The run id, not its URL: a URL folded at the terminal's width could not be copied; the URLs are
    # printed whole when the cells start, and ``runs_root`` says where the ids live.
    for column in ["cell", *keys, "state", "rounds", "final held-out loss", "run"]:
        table.add_column(column, no_wrap=True)
    for cell in cells:
        summary = cell.summary or {}
        loss = summary.get("final_eval_loss")
        rounds = f"{summary['rounds_committed']}/{summary['rounds']}" if summary else "-"
        table.add_row(
            str(cell.index),
            *(cell.values[k] for k in keys),
            cell.state,
            rounds,
            "-" if loss is None else f"{loss:.4f}",
            cell.prepared.plan.run_id,
        )
    return table


def runs_root(cells: list[Cell]) -> str:
    """The store the cells' runs live in: ``<root>/<run id>`` is a run's URL."""
    return cells[0].prepared.config.store


def _describe(values: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())

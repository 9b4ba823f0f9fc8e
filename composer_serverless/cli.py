"""``composer-serverless``: the command line. Thin: parse, configure logging, call the launcher or a run op.

Exit status 2 means the input was wrong (config, overrides, credentials, store, run URL) and nothing was
launched or written, or a backend refused something the user must fix (a token, credits, permissions);
1 means a run failed or was cancelled, or a backend kept failing for a transient reason (rate limits, server
errors, the network) past its retries.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.prompt import Prompt
from rich.table import Table

from composer_serverless.config import ConfigError, RunConfig, load_config, load_harvest_config
from composer_serverless.launch.report import outcome, progress_figure
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore, StoreError

if TYPE_CHECKING:
    from composer_serverless.harvest.plan import Prepared as HarvestPrepared
    from composer_serverless.launch.launcher import Prepared
    from composer_serverless.launch.sweep import Cell

DISTRIBUTION = "composer-serverless"

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train a Hugging Face causal LM with DiLoCo across replicas that meet only in an object store.",
    # Click's plain help, not Rich's: Rich reads "[tracking]" or "[output]" in a help text as markup and drops
    # it, and shows every flag with a value it rejects ("--dry-run <bool>").
    rich_markup_mode=None,
)
# Soft wrap: a message carrying a path, a URL or a command to copy is never broken across lines by the
# terminal's width (the terminal wraps it visually, and it still pastes whole).
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


class Executor(str, enum.Enum):
    local = "local"
    modal = "modal"
    hf_jobs = "hf_jobs"


ExecutorOption = Annotated[
    Executor | None,
    typer.Option("--executor", help="backend for the replicas; overrides the config's [executor]"),
]
ReplicasOption = Annotated[int | None, typer.Option(help="override diloco.replicas")]
SetOption = Annotated[list[str], typer.Option("--set", help="override any key: --set diloco.sync_every=20")]
ResumeSetOption = Annotated[
    list[str],
    typer.Option(
        "--set",
        help="override any key: --set diloco.sync_every=20; with --resume, only those a resume may change "
        "(diloco.rounds to a later end, train.lr, evaluation, checkpoints, timeouts, [tracking], [output], ...)",
    ),
]
RunArgument = Annotated[
    str, typer.Argument(help="the run's URL, as launch printed it (s3://bucket/runs/ID, ./runs/ID)")
]


def _log_at_info(verbose: bool) -> None:
    """``-v``: log at INFO. The option is the top level's and every command's, so that it works before the
    command or after it; it only ever raises the level, so one ``-v`` anywhere is enough."""
    if verbose:
        logging.getLogger().setLevel(logging.INFO)


def _print_version(asked: bool) -> None:
    if not asked:
        return
    try:
        typer.echo(f"{DISTRIBUTION} {metadata.version(DISTRIBUTION)}")
    except metadata.PackageNotFoundError:
        err_console.print(
            f"[red]error:[/] {DISTRIBUTION} is imported from a source tree but not installed, so it has no "
            "version\n  fix: pip install -e . in the source tree",
            highlight=False,
        )
        raise typer.Exit(2) from None
    raise typer.Exit()


# Read by its callback as the arguments are parsed, not by the commands (each takes it only to accept it).
VerboseOption = Annotated[
    bool,
    typer.Option("--verbose", "-v", help="log at INFO level", callback=_log_at_info, expose_value=False),
]


@app.callback()
def _main(
    verbose: VerboseOption = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="print the version and exit",
            callback=_print_version,
            is_eager=True,
            expose_value=False,
        ),
    ] = False,
) -> None:
    # No level here: ``-v`` (before the command) has set it already; WARNING is the root logger's default.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO; the harvest's own lines say what matters (retries, give-ups).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # huggingface_hub gives its loggers a handler of their own (when it is imported, maybe later than this), so
    # its lines printed twice, there and through ours; and it narrates each retry of its own, which our
    # backoff sums up (executors/retrying.py).
    logging.getLogger("huggingface_hub").propagate = False
    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Wrong input -> exit 2 with its message; a failed or cancelled run -> exit 1."""
    from composer_serverless.executors.base import BackendError
    from composer_serverless.launch.supervisor import RunCancelled, RunFailed, Terminated

    try:
        yield
    except (ConfigError, StoreError) as e:
        err_console.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    except BackendError as e:
        err_console.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(e.exit_code) from None
    except RunFailed as e:
        err_console.print(f"[red]run failed:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(1) from None
    except RunCancelled as e:
        err_console.print(f"[yellow]run cancelled:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(1) from None
    except Terminated:  # before the run was watched: whatever had started was cancelled on the way out
        err_console.print(
            "[yellow]stopped:[/] the launcher was sent SIGTERM before it watched the run; any replica it had "
            "started was cancelled",
            highlight=False,
        )
        raise typer.Exit(1) from None


def _print_table(table: Table) -> None:
    """Print ``table`` at its natural width even on a narrower terminal: a cropped cell (``diloco.outer…``)
    loses what it says, a line the terminal wraps does not."""
    natural = console.measure(table, options=console.options.update(max_width=sys.maxsize)).maximum
    Console(width=max(console.width, natural)).print(table)


def ask_cancel_or_detach() -> str:
    """Ctrl-C while watching: cancel the replicas (the default) or detach and leave them running."""
    try:
        answer = Prompt.ask(
            "\ninterrupted: [c]ancel the replicas, or [d]etach and leave them running?",
            choices=["c", "d"],
            default="c",
            console=err_console,
        )
    except (EOFError, KeyboardInterrupt):  # no one to ask, or a second Ctrl-C: cancel
        return "cancel"
    return "detach" if answer == "d" else "cancel"


def _overrides(set_: list[str], replicas: int | None) -> list[str]:
    return [*set_, *([f"diloco.replicas={replicas}"] if replicas is not None else [])]


@app.command()
def launch(
    config: Annotated[
        Path | None,
        typer.Argument(help="TOML config, e.g. deploy/configs/local-demo.toml; omitted with --resume"),
    ] = None,
    executor: ExecutorOption = None,
    replicas: ReplicasOption = None,
    set_: ResumeSetOption = [],  # noqa: B006
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print the plan and its cost; touch no network, start nothing")
    ] = False,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN",
            help="restart every replica of the run at this URL from its latest state",
        ),
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Validate the config, create the run in the store, start the replicas and watch them to the end.

    With --resume RUN, restart the replicas of an existing run instead (after they all died): they continue
    from its latest published state and their own saved state, with the configuration it was created with,
    or with the keys a resume may change changed by --set (a finished run: --set diloco.rounds=<more>).
    """
    from composer_serverless.launch import launcher
    from composer_serverless.launch.supervisor import sigterm_cancels

    # From the start, not only inside ``launch``: SIGTERM while the config is read or a run prepared ends
    # with the message, not silently.
    with _user_errors(), sigterm_cancels():
        if resume is not None:
            if config is not None or replicas is not None or executor is not None or dry_run:
                raise ConfigError(
                    "--resume continues a run with the config in its store\n"
                    "  fix: pass only --resume RUN, and --set for the keys a resume may change (no CONFIG, "
                    "--replicas, --executor or --dry-run)"
                )
            launcher.resume(resume, console, on_interrupt=ask_cancel_or_detach, overrides=set_)
            return
        if config is None:
            raise ConfigError("missing CONFIG\n  fix: pass a TOML config to start a run, or --resume RUN")
        cfg = load_config(config, _overrides(set_, replicas), executor.value if executor else None)
        if dry_run:
            _print_dry_run(launcher.prepare(cfg, str(config), offline=True, console=err_console))
            return
        launcher.launch(cfg, str(config), console, on_interrupt=ask_cancel_or_detach)


def _print_dry_run(prepared: Prepared) -> None:
    from composer_serverless.launch import dry_run

    typer.echo(prepared.plan.to_json())
    _print_checked(prepared)
    ready = f"this machine has what the launch needs; left for the launch: {', '.join(dry_run.left_for_launch(prepared))}"
    _print_problems(prepared.problems, ready)


def _print_checked(prepared: Prepared, label: str = "") -> None:
    """A dry run's lines about one prepared run (``launch/dry_run.py``), each after ``label``."""
    from composer_serverless.launch import dry_run

    for line in (dry_run.settings(prepared), dry_run.model_line(prepared)):
        err_console.print(label + line, markup=False, highlight=False)
    for warning in dry_run.warnings(prepared):
        err_console.print(f"[yellow]{escape(label)}warning:[/] {escape(warning)}", highlight=False)
    plan = prepared.plan
    err_console.print(f"{label}estimated cost: {plan.cost.summary()}", markup=False, highlight=False)
    if plan.syncer_cost is not None:
        line = f"{label}estimated cost of the syncer ({plan.syncer_hardware()}): {plan.syncer_cost.summary()}"
        err_console.print(line, markup=False, highlight=False)


def _print_problems(problems: list[str], ready: str) -> None:
    if problems:
        err_console.print("[yellow]launch would stop here until these are fixed:[/]", highlight=False)
        for problem in problems:
            err_console.print(textwrap.indent(problem, "  "), markup=False, highlight=False)
    else:
        err_console.print(ready, markup=False, highlight=False)


@app.command()
def status(run: RunArgument, verbose: VerboseOption = False) -> None:
    """Each replica's state, round, step, latest loss (a composer run: rollout reward), last heartbeat and
    backend job id."""
    from composer_serverless.launch import runs

    with _user_errors():
        opened, rows, reported = runs.status(run)
    table = Table(
        title=f"{opened.config.run_id} on {opened.record.plan.executor}"
        + (" (cancelled)" if opened.record.cancelled else "")
    )
    figure = progress_figure(opened.config)
    for column in ("rank", "state", "attempt", "round", "step", figure, "last heartbeat", "backend id"):
        table.add_column(column, no_wrap=True)
    table.add_column("detail", overflow="fold")
    for row in rows:
        age = "-" if row.heartbeat_age_s is None else f"{row.heartbeat_age_s:.0f}s ago"
        table.add_row(
            str(row.rank),
            row.state,
            str(row.attempt),
            row.round,
            row.step,
            row.figure,
            age,
            row.backend_id,
            row.detail,
        )
    _print_table(table)
    finished = opened.store.exists(layout.SUMMARY)
    if finished:
        summary = json.loads(opened.store.get(layout.SUMMARY))
        figures = "; ".join(outcome(summary)) or "no held-out evaluation"
        console.print(f"finished: {figures}; report {opened.store.url_of(layout.SUMMARY)}", highlight=False)
    if opened.config.tracking.report_to:
        _relay_to_trackers(opened.store, opened.config, finished)
    if reported and opened.config.output.push_to_hub is not None:
        # The launcher pushes the model of a run it watched to the end; of one it detached from, the status
        # that writes its report does.
        from composer_serverless.outputs import export as exports

        with _user_errors():
            exports.publish(opened.store.url, opened.config.output, console)


def _relay_to_trackers(store: ObjectStore, config: RunConfig, finished: bool) -> None:
    """Log what the run's trackers have not been given yet (a run nobody watched: tracking/relay.py)."""
    from composer_serverless.tracking.relay import Relay

    relay = Relay(store, config)
    with _user_errors():
        try:
            steps = relay.catch_up(ended=finished)
        finally:
            relay.close()
    trackers = ", ".join(config.tracking.report_to)
    console.print(f"trackers ({trackers}): {steps} new steps logged", highlight=False)


@app.command()
def logs(
    run: RunArgument,
    rank: Annotated[int, typer.Option("--rank", help="which replica")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing until the replica ends")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Print a replica's log (its latest attempt)."""
    from composer_serverless.launch import runs

    with _user_errors():
        for line in runs.logs(run, rank, follow):
            typer.echo(line)


@app.command()
def cancel(run: RunArgument, verbose: VerboseOption = False) -> None:
    """Cancel every replica of the run; replicas that already ended are left as they are."""
    from composer_serverless.launch import runs

    with _user_errors():
        statuses = runs.cancel(run)
    for st in statuses:
        console.print(f"replica {st.rank}: {st.state} {st.detail}", markup=False, highlight=False)


@app.command()
def export(
    run: RunArgument,
    out: Annotated[Path, typer.Argument(help="new directory for the model (Hugging Face format)")],
    round_: Annotated[
        int | None,
        typer.Option(
            "--round",
            help="a round the run keeps a checkpoint of; default: the final model, or the newest checkpoint "
            "of a run that has none",
        ),
    ] = None,
    push_to_hub: Annotated[
        str | None, typer.Option("--push-to-hub", help="also upload it to this Hub repo")
    ] = None,
    private: Annotated[
        bool,
        typer.Option(
            "--private/--public",
            help="create the Hub repo private (default) or public; an existing repo keeps its visibility, and "
            "an existing public one is refused unless --public",
        ),
    ] = True,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="the weights' dtype in OUT: float32 (fp32) or bfloat16 (bf16, half the size); default: as "
            "trained"
        ),
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Copy a model of the run out of the store with its model card, and optionally push it to the Hub."""
    from composer_serverless.outputs import export as exports

    with _user_errors():
        done = exports.export(
            run, out, round_index=round_, dtype=dtype, push_to_hub=push_to_hub, private=private
        )
    what = "final model" if done.source.final else "checkpoint"
    console.print(
        f"{what} of round {done.source.round} copied to {out}"
        + (f"; pushed: {done.commit_url}" if done.commit_url else ""),
        markup=False,
    )


@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(help="TOML config every cell starts from")],
    grid: Annotated[
        list[str], typer.Option("--grid", help="key=v1,v2,...; one per key; every combination runs")
    ],
    executor: ExecutorOption = None,
    replicas: ReplicasOption = None,
    set_: SetOption = [],  # noqa: B006
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="check every cell and print its plan and cost; touch no network, start nothing"
        ),
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Run every combination of the --grid values as its own run, side by side; print a results table."""
    from composer_serverless.launch import sweep as grid_sweep
    from composer_serverless.launch.supervisor import sigterm_cancels

    with _user_errors(), sigterm_cancels():
        cells = grid_sweep.plan_sweep(
            config, grid, _overrides(set_, replicas), executor.value if executor else None, dry_run=dry_run
        )
        if dry_run:
            _print_sweep_dry_run(cells)
            return
        finished = grid_sweep.run_sweep(cells, console, on_interrupt=ask_cancel_or_detach)
    if finished is None:
        return
    _print_table(grid_sweep.results_table(finished))
    console.print(f"runs: {grid_sweep.runs_root(finished)}/<run>", markup=False, highlight=False)
    if any(cell.state != "succeeded" for cell in finished):
        raise typer.Exit(1)


def _print_sweep_dry_run(cells: list[Cell]) -> None:
    """Every cell's plan (a JSON list on stdout) and its checked lines; the problems of all cells once."""
    from composer_serverless.launch import dry_run
    from composer_serverless.launch.sweep import describe, problems

    typer.echo(json.dumps([json.loads(cell.prepared.plan.to_json()) for cell in cells], indent=2))
    for cell in cells:
        err_console.print(f"{cell.label} ({describe(cell.values)}):", markup=False, highlight=False)
        _print_checked(cell.prepared, label="  ")
    left = dict.fromkeys(item for cell in cells for item in dry_run.left_for_launch(cell.prepared))
    _print_problems(
        problems(cells), f"this machine has what the sweep needs; left for the launch: {', '.join(left)}"
    )


@app.command()
def harvest(
    config: Annotated[
        Path, typer.Argument(help="TOML file with a [harvest] table (a run's config, or that table alone)")
    ],
    set_: SetOption = [],  # noqa: B006
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="print the plan and its worst-case and expected cost; send nothing"),
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Ask the [harvest] teachers about each state (a trace file, or a run's latest rollouts) and write the
    preference pairs they agree on, under the max_usd cap; answers are cached in the store."""
    from composer_serverless.harvest import plan

    with _user_errors():
        prepared = plan.prepare(load_harvest_config(config, set_))
        if dry_run:
            _print_harvest_plan(prepared)
            return
        with _harvest_progress() as progress:
            result = plan.run(prepared, progress)
    from composer_serverless.harvest.stats import summary_lines, table

    _print_table(table(result))
    for line in summary_lines(result):
        console.print(line, markup=False, highlight=False)
    console.print(f"pairs: {prepared.output_url}", markup=False, highlight=False)
    if result.problems:
        for problem in result.problems:
            err_console.print(f"[red]error:[/] {escape(problem)}", highlight=False)
        raise typer.Exit(1)


def _print_harvest_plan(prepared: HarvestPrepared) -> None:
    from composer_serverless.harvest import plan

    doc = plan.plan_json(prepared, plan.estimate(prepared))
    typer.echo(json.dumps(doc, indent=2))
    worst, cap = doc["worst_usd"], doc["max_usd"]
    err_console.print(
        f"estimated cost: expected ${doc['expected_usd']:.4f}, at most ${worst:.4f} (cap ${cap:.2f})"
        + ("; the cap will stop the harvest before it is done" if worst > cap else ""),
        markup=False,
        highlight=False,
    )
    problem = plan.key_problem(prepared.config)
    if problem is not None:
        err_console.print(textwrap.indent(problem, "  "), markup=False, highlight=False)


@contextlib.contextmanager
def _harvest_progress() -> Iterator[Callable[[int, int, float], None]]:
    """A bar over the prompt-teacher queries, with the money spent so far."""
    bar = Progress(
        TextColumn("harvest"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("${task.fields[spent]:.4f} spent"),
        console=err_console,
    )
    task = bar.add_task("", total=None, spent=0.0)

    def update(done: int, total: int, spent: float) -> None:
        bar.update(task, completed=done, total=total, spent=spent)

    with bar:
        yield update


def run(argv: list[str]) -> int:
    """Run the CLI with ``argv`` and return its exit status (for the Modal entrypoints)."""
    try:
        app(argv, prog_name="composer-serverless")
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())

"""Validate -> plan -> check this machine -> create the run in the store -> launch -> watch -> report.

The launcher and the replicas share nothing but the store: the launcher writes ``run.json`` (and the tiny
model, if the config asks for one), starts the replicas with the run's URL, records how to find them again
(``launch.json``), draws their heartbeats, and finally writes the report from the metrics they left in the
store. Everything that can be checked is checked before the first write: the config and the plan (no
network), this machine's credentials (no network), then the store (one probe object, deleted again).

Ctrl-C while watching asks whether to cancel the replicas or detach from them; a detached run keeps going,
and ``status``, ``logs`` and ``cancel`` reach it later through its URL. ``resume`` restarts every replica of
an existing run whose replicas all died: they continue from its latest published state.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from composer_serverless.config import ConfigError, RunConfig, validate_config
from composer_serverless.executors import make_executor
from composer_serverless.executors.base import LaunchPlan, LaunchRecord, ServerlessExecutor
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics
from composer_serverless.replicas.composer import preflight
from composer_serverless.replicas.objective import preflight_text
from composer_serverless.report import eval_headline, write_report
from composer_serverless.runs import RUN_URL_HINT, STORE_HINT, absolute_store, open_store
from composer_serverless.supervisor import RunCancelled, Supervisor, Terminated

logger = logging.getLogger(__name__)

HEARTBEAT_POLL_S = 1.0
LOCAL_STATUS_POLL_S = 1.0

Choice = Literal["cancel", "detach"]

__all__ = [
    "Prepared",
    "prepare",
    "start",
    "launch",
    "resume",
    "follow",
    "watch",
    "create_run",
]


def cancel_on_interrupt() -> Choice:
    """The non-interactive answer to Ctrl-C: nobody can be asked, so do not leave replicas billing."""
    return "cancel"


def new_run_id(source: str) -> str:
    stem = "".join(c if c.isalnum() else "-" for c in Path(source).stem.lower()).strip("-")[:30] or "run"
    return f"{stem}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def create_run(config: RunConfig, source: str, console: Console) -> tuple[ObjectStore, RunConfig]:
    """Create the run in the store: model (if built here) first, ``run.json`` last and exactly once."""
    root = ObjectStore(config.store)
    root.ensure_root()
    run_id = config.run_id or new_run_id(source)
    run = root.child(run_id)
    if run.exists(layout.RUN_CONFIG):
        raise ConfigError(
            f"run {run.url} already exists\n  fix: choose another run_id, or leave run_id unset"
        )
    # Validated again (model_copy would not): whatever reaches run.json is exactly what replicas will accept.
    resolved = validate_config({**config.model_dump(), "run_id": run_id}, source="the resolved config")
    if resolved.model.tiny is not None:
        with console.status("building the tiny model and its tokenizer"):
            _build_tiny_into(run, resolved)
    if not run.create(layout.RUN_CONFIG, resolved.resolved_json().encode()):
        raise ConfigError(
            f"run {run.url} was created concurrently by someone else\n  fix: choose another run_id"
        )
    return run, resolved


def _build_tiny_into(run: ObjectStore, config: RunConfig) -> None:
    from transformers.utils import logging as hf_logging

    from composer_serverless.models import build_tiny
    from composer_serverless.replicas.data import stdlib_corpus, training_text

    hf_logging.disable_progress_bar()
    tiny = config.model.tiny
    assert tiny is not None
    texts: Iterable[str] = ()
    if tiny.tokenizer == "bpe":
        corpus = stdlib_corpus(config.data.heldout_percent)
        texts = training_text(corpus, int(tiny.tokenizer_corpus_mb * 1e6), config.seed)
    with tempfile.TemporaryDirectory() as out:
        build_tiny(tiny, texts, Path(out), seed=config.seed)
        run.upload_dir(Path(out), layout.MODEL)


@dataclass
class Prepared:
    """A run decided but not started: resolved config (run id, absolute local store), executor, plan.

    ``problems`` lists what this machine lacks for the launch (credentials, ...), found without network.
    """

    config: RunConfig
    source: str
    run: ObjectStore
    executor: ServerlessExecutor
    plan: LaunchPlan
    problems: list[str]


def prepare(config: RunConfig, source: str) -> Prepared:
    """Resolve the run id, build the executor and its plan; raises ConfigError for a plan that cannot work."""
    store = absolute_store(config.store)
    run_id = config.run_id or new_run_id(source)
    # Validated again (model_copy would not): the plan is built from exactly what run.json will hold.
    raw = {**config.model_dump(), "run_id": run_id, "store": store}
    resolved = validate_config(raw, source="the resolved config")
    if resolved.train.objective == "composer":
        preflight(resolved)  # reads every data file and resolves every reward: bad records fail here
    else:
        preflight_text(resolved)
    run = open_store(store, fix=STORE_HINT).child(run_id)
    executor = make_executor(resolved, run)
    plan = executor.plan(resolved, run.url)
    return Prepared(resolved, source, run, executor, plan, executor.preflight(plan))


def start(prepared: Prepared, console: Console) -> Supervisor:
    """Create the run in the store and start its replicas; nothing is written if a check fails first."""
    if prepared.problems:
        raise ConfigError("cannot launch:\n" + "\n".join(textwrap.indent(p, "  ") for p in prepared.problems))
    run, _ = create_run(prepared.config, prepared.source, console)
    handles = prepared.executor.launch(prepared.plan)
    supervisor = Supervisor(
        run, prepared.executor, LaunchRecord(prepared.plan, tuple(handles), created_at=time.time())
    )
    try:
        supervisor.save()
    except BaseException:
        prepared.executor.cancel(handles)  # replicas nobody could find again must not keep running
        raise
    return supervisor


def launch(
    config: RunConfig, source: str, console: Console, on_interrupt: Callable[[], Choice] = cancel_on_interrupt
) -> dict[str, Any] | None:
    """Run ``config`` to the end and return its summary, or None if the user detached.

    Raises:
        ConfigError: the config, the plan or this machine's setup cannot work; nothing was launched.
        StoreError: the store cannot be written; nothing was launched.
        RunFailed: a replica failed for good; the others were cancelled.
        RunCancelled: the run was cancelled, here (Ctrl-C, then "cancel") or from elsewhere.
    """
    prepared = prepare(config, source)
    supervisor = start(prepared, console)
    return follow(supervisor, prepared.config, console, on_interrupt)


def resume(
    run_url: str, console: Console, on_interrupt: Callable[[], Choice] = cancel_on_interrupt
) -> dict[str, Any] | None:
    """Restart every replica of the run at ``run_url`` and watch it to its end, as ``launch`` does.

    The replicas continue from the run's ``state/LATEST`` and their own saved state, with the configuration
    the run was created with (``run.json`` is write-once). The launch record starts afresh: the attempts of
    the replicas that died are of no use to ``status``, ``logs`` or ``cancel`` any more.

    Raises:
        ConfigError: ``run_url`` holds no run, or this machine cannot launch its replicas; nothing started.
        StoreError: the store cannot be written; nothing was launched.
        RunFailed, RunCancelled: as for ``launch``.
    """
    run = open_store(run_url.rstrip("/"))
    try:
        raw = run.get(layout.RUN_CONFIG)
    except FileNotFoundError:
        raise ConfigError(
            f"{run_url} is not a run: there is no {layout.RUN_CONFIG} there\n  fix: {RUN_URL_HINT}"
        ) from None
    config = RunConfig.model_validate_json(raw)
    executor = make_executor(config, run)
    plan = executor.plan(config, run.url)
    problems = executor.preflight(plan)
    if problems:
        raise ConfigError("cannot resume:\n" + "\n".join(textwrap.indent(p, "  ") for p in problems))
    run.ensure_root()
    console.print(f"resuming run [bold]{config.run_id}[/] after round {latest_round(run)}", highlight=False)
    handles = executor.launch(plan)
    supervisor = Supervisor(run, executor, LaunchRecord(plan, tuple(handles), created_at=time.time()))
    try:
        supervisor.save()
    except BaseException:
        executor.cancel(handles)
        raise
    return follow(supervisor, config, console, on_interrupt)


def follow(
    supervisor: Supervisor,
    config: RunConfig,
    console: Console,
    on_interrupt: Callable[[], Choice] = cancel_on_interrupt,
) -> dict[str, Any] | None:
    """Watch a started run to its end, then write and print its report; None if the user detached."""
    plan = supervisor.record.plan
    console.print(
        f"run [bold]{plan.run_id}[/] at {supervisor.run.url}: {len(plan.replicas)} {plan.executor} replicas\n"
        f"  estimated cost: {plan.cost.summary()}",
        highlight=False,
    )
    started = time.monotonic()
    try:
        watch(supervisor, config, console)
    except KeyboardInterrupt:
        if on_interrupt() == "detach":
            print_detached(supervisor.run.url, console)
            return None
        supervisor.cancel()
        raise RunCancelled("cancelled at your request") from None
    except Terminated:
        supervisor.cancel()
        raise RunCancelled(Terminated.message) from None
    except BaseException:
        # A failed run must not keep its other replicas billing.
        supervisor.executor.cancel(supervisor.handles)
        raise
    summary = write_report(supervisor.run, config, time.monotonic() - started)
    print_report(supervisor.run, summary, console)
    return summary


def print_detached(url: str, console: Console) -> None:
    console.print(
        f"\ndetached: the replicas keep running.\n"
        f"  composer-serverless status {url}\n"
        f"  composer-serverless logs {url} --rank 0 --follow\n"
        f"  composer-serverless cancel {url}",
        highlight=False,
    )


def status_poll_s(config: RunConfig) -> float:
    return getattr(config.executor, "status_poll_s", LOCAL_STATUS_POLL_S)


def watch(supervisor: Supervisor, config: RunConfig, console: Console) -> None:
    """Draw per-replica progress until every replica has ended.

    Progress comes from the heartbeats in the store (every second); the backend is asked for the replicas'
    states only every ``executor.status_poll_s``, since on a cloud backend each ask is a rate-limited call.
    """
    dl = config.diloco
    total = dl.rounds * dl.sync_every
    progress = Progress(
        TextColumn("replica {task.fields[rank]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "round {task.fields[round]}/{task.fields[rounds]}  loss {task.fields[loss]}  {task.fields[state]}"
        ),
        console=console,
    )
    tasks = {
        h.rank: progress.add_task(
            "", total=total, rank=h.rank, round=0, rounds=dl.rounds, loss="-", state="pending"
        )
        for h in supervisor.handles
    }
    states: dict[int, str] = {}
    reported_rounds: set[int] = set()
    next_status = 0.0
    with progress:
        while True:
            finished = False
            if time.monotonic() >= next_status:
                poll = supervisor.poll()
                next_status = time.monotonic() + status_poll_s(config)
                for event in poll.events:
                    progress.console.print(f"[yellow]{escape(event)}[/]", highlight=False)
                states = {
                    s.rank: s.state if s.state != "pending" else f"pending: {s.detail}" for s in poll.statuses
                }
                finished = poll.finished
            beats = read_heartbeats(supervisor.run)
            for rank, task in tasks.items():
                beat, backend = beats.get(rank, {}), states.get(rank, "pending")
                fields: dict[str, Any] = {
                    "state": beat.get("state", backend) if backend == "running" else backend
                }
                if beat:
                    fields.update(
                        completed=max(0, beat.get("round", 1) - 1) * dl.sync_every + beat.get("step", 0),
                        round=beat.get("round", 0),
                    )
                if "loss" in beat:  # beats without one (starting, done) keep the last loss on screen
                    fields["loss"] = f"{beat['loss']:.3f}"
                progress.update(task, **fields)
            _print_new_rounds(supervisor.run, reported_rounds, dl.rounds, progress.console)
            if finished:
                return
            time.sleep(HEARTBEAT_POLL_S)


def _print_new_rounds(run: ObjectStore, reported: set[int], rounds: int, console: Console) -> None:
    # The evaluator of a round is its lowest-rank participant, so any replica's metrics may carry it.
    rows = sorted(
        (r for rank_rows in read_metrics(run).values() for r in rank_rows), key=lambda r: r["round"]
    )
    for row in rows:
        if row["round"] in reported or "eval" not in row:
            continue
        reported.add(row["round"])
        label = "initial model" if row["round"] == 0 else f"round {row['round']}/{rounds}"
        console.print(f"  {label}: {eval_headline(row['eval'])}")


def print_report(run: ObjectStore, summary: dict[str, Any], console: Console) -> None:
    console.print(
        f"\n[bold]done[/]: {summary['rounds_committed']}/{summary['rounds']} rounds committed on "
        f"{summary['replicas']} replicas in {summary['wall_s']:.0f}s"
    )
    for what, key in (("loss", "eval_loss"), ("reward", "eval_reward")):
        if summary[f"final_{key}"] is not None:
            console.print(
                f"held-out {what} of the global model: {summary[f'initial_{key}']:.4f} -> "
                f"[bold]{summary[f'final_{key}']:.4f}[/]"
            )
    console.print(
        f"replicas bit-identical after every sync: {summary['replicas_bit_identical']}; "
        f"moved {summary['bytes_uploaded'] / 1e6:.1f} MB up, {summary['bytes_downloaded'] / 1e6:.1f} MB down"
    )
    plots = [("reward plot", layout.REWARD_PLOT)] if summary["final_eval_reward"] is not None else []
    for what, key in (
        ("summary", layout.SUMMARY),
        ("plot", layout.LOSS_PLOT),
        *plots,
        ("final model", layout.FINAL),
    ):
        console.print(f"  {what:12s} {run.url_of(key)}")

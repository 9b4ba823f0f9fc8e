"""Validate -> create the run in the store -> plan -> launch -> watch (progress) -> report.

The launcher and the replicas share nothing but the store: the launcher writes ``run.json`` (and the tiny
model, if the config asks for one), starts the replicas with the run's URL, draws their heartbeats, and
finally writes the report from the metrics they left in the store.
"""

from __future__ import annotations

import json
import logging
import secrets
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from composer_serverless.config import ConfigError, RunConfig
from composer_serverless.executors.base import TERMINAL_STATES, ReplicaHandle, ServerlessExecutor
from composer_serverless.executors.local import LocalProcessExecutor
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.composer import preflight
from composer_serverless.replicas.trainer import FINAL_PREFIX, MODEL_PREFIX
from composer_serverless.report import PLOT_KEY, REWARD_PLOT_KEY, SUMMARY_KEY, eval_headline, write_report
from composer_serverless.telemetry import read_heartbeats, read_metrics

logger = logging.getLogger(__name__)

POLL_S = 1.0
LOG_TAIL_LINES = 30


class RunFailed(RuntimeError):
    """A replica failed; the message carries the end of its log."""


def new_run_id(source: str) -> str:
    stem = "".join(c if c.isalnum() else "-" for c in Path(source).stem.lower()).strip("-")[:30] or "run"
    return f"{stem}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def create_run(config: RunConfig, source: str, console: Console) -> tuple[ObjectStore, RunConfig]:
    """Create the run in the store: model (if built here) first, ``run.json`` last and exactly once."""
    root = ObjectStore(config.store)
    root.ensure_root()
    run_id = config.run_id or new_run_id(source)
    run = root.child(run_id)
    if run.exists("run.json"):
        raise ConfigError(f"run {run.url} already exists\n  fix: choose another run_id, or leave run_id unset")
    resolved = config.model_copy(update={"run_id": run_id})
    if resolved.model.tiny is not None:
        with console.status("building the tiny model and its tokenizer"):
            _build_tiny_into(run, resolved)
    if not run.create("run.json", resolved.resolved_json().encode()):
        raise ConfigError(f"run {run.url} was created concurrently by someone else\n  fix: choose another run_id")
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
        run.upload_dir(Path(out), MODEL_PREFIX)


def make_executor(config: RunConfig, run: ObjectStore) -> ServerlessExecutor:
    log_dir = run.local_dir("logs") or Path(".composer-serverless") / (config.run_id or "run") / "logs"
    return LocalProcessExecutor(log_dir)


def launch(config: RunConfig, source: str, console: Console) -> dict[str, Any]:
    """Run ``config`` to the end and return its summary; raises RunFailed if a replica fails."""
    if config.train.objective == "composer":
        preflight(config)
    run, resolved = create_run(config, source, console)
    console.print(f"run [bold]{resolved.run_id}[/] at {run.url}")
    executor = make_executor(resolved, run)
    plan = executor.plan(resolved, run.url)
    started = time.monotonic()
    handles = executor.launch(plan)
    run.put("launch.json", json.dumps({"plan": json.loads(plan.to_json()), "handles": [asdict(h) for h in handles]}).encode())
    try:
        watch(run, resolved, executor, handles, console)
    except BaseException:
        executor.cancel(handles)
        raise
    summary = write_report(run, resolved, time.monotonic() - started)
    print_report(run, summary, console)
    return summary


def watch(
    run: ObjectStore, config: RunConfig, executor: ServerlessExecutor, handles: list[ReplicaHandle], console: Console
) -> None:
    """Draw per-replica progress from heartbeats until every replica has ended; fail fast on a failure."""
    dl = config.diloco
    total = dl.rounds * dl.sync_every
    progress = Progress(
        TextColumn("replica {task.fields[rank]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("round {task.fields[round]}/{task.fields[rounds]}  loss {task.fields[loss]}  {task.fields[state]}"),
        console=console,
    )
    tasks = {h.rank: progress.add_task("", total=total, rank=h.rank, round=0, rounds=dl.rounds, loss="-", state="pending") for h in handles}
    reported_rounds: set[int] = set()
    with progress:
        while True:
            for rank, beat in read_heartbeats(run).items():
                done = max(0, beat.get("round", 1) - 1) * dl.sync_every + beat.get("step", 0)
                loss = f"{beat['loss']:.3f}" if "loss" in beat else "-"
                progress.update(tasks[rank], completed=done, round=beat.get("round", 0), loss=loss, state=beat["state"])
            _print_new_rounds(run, reported_rounds, dl.rounds, progress.console)
            statuses = executor.status(handles)
            failed = [s for s in statuses if s.state == "failed"]
            if failed:
                handle = next(h for h in handles if h.rank == failed[0].rank)
                tail = list(executor.logs(handle))[-LOG_TAIL_LINES:]
                raise RunFailed(
                    f"replica {handle.rank} failed ({failed[0].detail}); last lines of {handle.log}:\n" + "\n".join(tail)
                )
            if all(s.state in TERMINAL_STATES for s in statuses):
                _print_new_rounds(run, reported_rounds, dl.rounds, progress.console)
                return
            time.sleep(POLL_S)


def _print_new_rounds(run: ObjectStore, reported: set[int], rounds: int, console: Console) -> None:
    for row in read_metrics(run).get(0, []):
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
    plots = [("reward plot", REWARD_PLOT_KEY)] if summary["final_eval_reward"] is not None else []
    for what, key in (("summary", SUMMARY_KEY), ("plot", PLOT_KEY), *plots, ("final model", FINAL_PREFIX)):
        console.print(f"  {what:12s} {run.url_of(key)}")

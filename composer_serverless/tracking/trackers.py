"""The experiment trackers a run's metrics are relayed to, each through its own client: TensorBoard's event
files (the ``tensorboard`` package's writer: no torch, no TensorFlow), trackio (its local SQLite store, or a
Space) and W&B (online, or offline for ``wandb sync``). Each is imported only when a run names it.

A tracker run is opened for one training run and may be opened again by a later relay (``status`` after a
detach): TensorBoard starts a new event file in the same directory, named to be read after the earlier
ones; trackio and W&B resume the run of the same name or id. The relay never logs a step twice
(``relay.py``), so a reopened run only goes on.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from composer_serverless.config.base import ConfigError
from composer_serverless.config.outputs import TRACKER_PACKAGES, TrackingConfig

logger = logging.getLogger(__name__)


class Tracker(Protocol):
    name: str

    def log_config(self) -> None:
        """Record the run's config, once per tracker run (trackers that take it when opened do nothing)."""
        ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def table(self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TrackerUnavailable(ConfigError):
    """A tracker the config names cannot be opened here (its package is not installed)."""


def missing(tracking: TrackingConfig) -> list[str]:
    """Before a run starts, where the relay runs (the launcher): the trackers it reports to that cannot be
    opened here, each with how to fix it."""
    import importlib.util

    absent = [name for name in tracking.report_to if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None]
    if not absent:
        return []
    return [
        f"tracking.report_to names {', '.join(absent)}, not installed here (the launcher logs to the trackers)"
        "\n  fix: pip install 'composer-serverless[tracking]', or remove them from report_to"
    ]


def open_tracker(
    name: str, tracking: TrackingConfig, run_id: str, config: dict[str, Any], directory: Path
) -> Tracker:
    """Open (or reopen) the tracker run of training run ``run_id``; its files go under ``directory``."""
    title = tracking.name or run_id
    try:
        if name == "tensorboard":
            return TensorBoardTracker(directory / "tensorboard", config)
        if name == "trackio":
            return TrackioTracker(tracking.project, title, config)
        if name == "wandb":
            return WandbTracker(tracking, run_id, title, config, directory)
    except ImportError as e:
        raise TrackerUnavailable(
            f"tracking.report_to names {name!r}, which cannot be imported here ({e}); "
            "fix: pip install 'composer-serverless[tracking]', or remove it from report_to"
        ) from None
    raise ValueError(f"unknown tracker {name!r}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """A client's own prints (banners, dashboard hints, on stdout and stderr) go to the log, not over the
    launcher's display."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        yield
    for line in out.getvalue().splitlines():
        if line.strip():
            logger.info("%s", line)


# An event file's name: its writer's second, then its host, pid and a per-process counter.
_EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


def _past_every_event_file(directory: Path) -> None:
    """Wait until the clock's second is past that of every event file in ``directory`` (a second at most).

    TensorBoard reads a run's event files in the order of their names, which begin with the second their
    writer opened, then sort as text: its host, its pid, and a counter of the writers its process opened (10
    before 9). A run reopened within the second it was last opened (``status`` right after the launcher
    detached; a process's tenth tracker run) would have its new steps read before the earlier ones."""
    seconds = [int(m.group(1)) for path in directory.iterdir() if (m := _EVENT_FILE.match(path.name))]
    wait = max(seconds, default=0) + 1 - time.time()
    if wait > 0:
        time.sleep(min(wait, 1.0))


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        _past_every_event_file(directory)
        self._writer = EventFileWriter(str(directory))
        self._config = config

    def log(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()]
        )
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def text(self, step: int, key: str, markdown: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text import metadata
        from tensorboard.util import tensor_util

        value = summary_pb2.Summary.Value(
            tag=key,
            metadata=metadata.create_summary_metadata(key, ""),
            tensor=tensor_util.make_tensor_proto(markdown),
        )
        event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value]))
        self._writer.add_event(event)

    def table(self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.text(step, key, markdown_table(columns, rows))

    def log_config(self) -> None:
        import json

        self.text(0, "config", "```json\n" + json.dumps(self._config, indent=2, sort_keys=True) + "\n```")

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TrackioTracker:
    name = "trackio"

    def __init__(self, project: str, title: str, config: dict[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        with _quiet():
            # System metrics would be the launcher's machine's, not the replicas': off.
            self._run = trackio.init(
                project=project,
                name=title,
                config=config,
                resume="allow",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def table(self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._run.log(
            {key: self._trackio.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step
        )

    def log_config(self) -> None:
        """trackio takes the config at ``init``."""

    def flush(self) -> None:
        """trackio writes as it is given values (its run batches them and ``finish`` waits for them)."""

    def close(self) -> None:
        from trackio import context_vars

        with _quiet():
            self._run.finish()
        if context_vars.current_run.get() is self._run:  # else trackio finishes it again at exit, aloud
            context_vars.current_run.set(None)


class WandbTracker:
    name = "wandb"

    def __init__(
        self, tracking: TrackingConfig, run_id: str, title: str, config: dict[str, Any], directory: Path
    ) -> None:
        import wandb

        self._wandb = wandb
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(quiet=True, console="off", x_disable_stats=True, disable_git=True)
        with _quiet():
            self._run = wandb.init(
                project=tracking.project,
                name=title,
                id=run_id,
                resume="allow",
                mode=tracking.wandb_mode,
                dir=str(directory),
                config=config,
                settings=settings,
                reinit="create_new",  # a sweep relays several runs from one process
            )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def table(self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._run.log(
            {key: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step
        )

    def log_config(self) -> None:
        """W&B takes the config at ``init``."""

    def flush(self) -> None:
        """W&B's service writes as it is given values; ``finish`` waits for them."""

    def close(self) -> None:
        with _quiet():
            self._run.finish()


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (TensorBoard's text dashboard renders it), cells on one line each."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)

"""A fake of the part of the Modal SDK the executor uses, behaving as the real client does (modal 1.6.4).

It replaces, in the test process, the objects ``ModalExecutor`` reaches: the replica App's ``run``, the
replica function's and the syncer function's ``with_options(...).spawn``, ``modal.FunctionCall.from_id``, ``modal.App.lookup``,
``modal.Client.from_env`` and ``modal.Secret.from_dict``/``from_name``. Everything else in the executor runs
as it does against Modal. What the real client does, and the fake does too (read from the installed wheel):

* ``App.run(detach=True)`` swallows a KeyboardInterrupt raised inside its block and returns
  (``modal/runner.py``, ``_run_app``: "The detached App will keep running"); an ephemeral app (no detach)
  is stopped when its block is left.
* ``FunctionCall.get(timeout=0)`` raises the built-in ``TimeoutError`` while the call has no output; an
  output goes through the client's own ``_process_result`` with a real ``api_pb2.GenericResult``, so a
  cancelled call (terminated result) raises ``RemoteError``, a timed-out one ``FunctionTimeoutError``, a
  failed one the replica's own exception, exactly as the real client raises them.
* Log entries are ``modal.types.LogEntry`` chunks of the container's output cut wherever the container's
  writes fell, not at line ends; ``logs.tail(entries=n)`` gives the last n entries.
* Modal retries a failed call itself (``Retries.max_retries``), each attempt in a fresh container.
* A ``with_options`` variant is hydrated at its first use, from the function of the app running then, and
  stays bound to that app (``_make_function_variant``; ``spawn`` is a ``live_method`` that hydrates only an
  unhydrated object): every later spawn of it runs in that app, whichever app runs now.
* Stopping an app terminates its running calls; an unknown id raises ``NotFoundError``.

Every stand-in binds its arguments to the installed SDK's signature before it acts (``with_options`` and
``Secret.from_dict`` call the real ones), so a call the real client would refuse with a TypeError is refused
here too; ``used`` names the entry points the executor reached.

Each spawned replica runs as a local process with a minimal "image" environment plus the options' env and
the secrets' values, and nothing else, so a secret the executor forgot to request is really missing. A
container has the GPU it was given: the process runs on the simulated accelerator
(``accelerator/simulated.py``), so replicas take their CUDA path; a container given none (the syncer's CPU
function) has none.
``interrupt_at`` sends this process a real SIGINT at points of the spawn sequence; ``fail`` makes a named
SDK call raise a Modal API error.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from composer_serverless.accelerator import SIMULATED_ENV
from composer_serverless.executors.base import worker_argv

REPO = Path(__file__).resolve().parents[2]
# Points of the spawn sequence ``interrupt_at`` can name, in order.
SPAWN_POINTS = ("app.run", "app.created", "spawn.before", "spawn.created", "spawn.returned", "app.exit")


@dataclass
class FakeCall:
    call_id: str
    app_id: str
    rank: int
    argv: list[str]
    env: dict[str, str]
    log: Path
    max_retries: int
    function: str = "train_replica"
    proc: subprocess.Popen[bytes] | None = None
    attempts: int = 0
    # None while running, else (status name, data for the result)
    result: tuple[str, Any] | None = None


@dataclass
class FakeApp:
    app_id: str
    name: str | None
    detach: bool
    stopped: bool = False
    calls: list[str] = field(default_factory=list)


class FakeModal:
    """The fake Modal: its apps and calls, the SDK objects that reach them, and what tests inject."""

    def __init__(self, logs_dir: Path) -> None:
        self.logs_dir = logs_dir
        self.apps: dict[str, FakeApp] = {}
        self.calls: dict[str, FakeCall] = {}
        self.options: list[dict[str, Any]] = []
        # (point, rank) pairs: at each, a real SIGINT to this process (a pair listed twice: two of them)
        self.interrupt_at: list[tuple[str, int]] = []
        self.failures: dict[str, list[BaseException]] = {}
        self.requests: list[str] = []
        # The SDK entry points the executor called, each checked against the installed SDK's signature.
        self.used: set[str] = set()
        self.secret_values: dict[int, dict[str, str]] = {}
        # What a replica runs: the worker, or (for tests about the launch itself) something that only waits.
        self.command: Callable[[str, int], list[str]] = lambda run_url, rank: list(
            worker_argv(run_url, rank, sys.executable)
        )
        self._lock = threading.Lock()

    # --- what tests use ---------------------------------------------------------------------------------

    def fail(self, method: str, *errors: BaseException) -> None:
        """Make the next calls of ``method`` (``hello``, ``get``, ``cancel``, ``stop``, ``spawn``, ``logs``)
        raise ``errors``, one each."""
        self.failures.setdefault(method, []).extend(errors)

    def live(self) -> list[FakeCall]:
        return [c for c in self.calls.values() if c.proc is not None and c.proc.poll() is None]

    def terminate(self, call_id: str) -> None:
        """What the dashboard's cancel does: the call ends with a terminated result."""
        self._end(self.calls[call_id], ("terminated", "Function call cancelled"))

    def kill_all(self) -> None:
        for call in self.calls.values():
            if call.proc is not None and call.proc.poll() is None:
                os.killpg(call.proc.pid, signal.SIGKILL)
                call.proc.wait()

    # --- inside ----------------------------------------------------------------------------------------

    def _shaped_as(self, name: str, real: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A stand-in's calls bound to the installed SDK's signature of ``real`` first: an argument the SDK
        does not take raises the TypeError the SDK would (a method's ``self`` stands for the SDK object's)."""
        signature = inspect.signature(real)

        def shape(stand_in: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(stand_in)
            def checked(*args: Any, **kwargs: Any) -> Any:
                signature.bind(*args, **kwargs)
                self.used.add(name)
                return stand_in(*args, **kwargs)

            return checked

        return shape

    def _api(self, method: str) -> None:
        self.requests.append(method)
        queued = self.failures.get(method)
        if queued:
            raise queued.pop(0)

    def _point(self, point: str, rank: int) -> None:
        while (point, rank) in self.interrupt_at:
            self.interrupt_at.remove((point, rank))
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs between bytecodes of the main thread: let it

    def _start(self, call: FakeCall) -> None:
        call.attempts += 1
        with open(call.log, "ab") as log:
            call.proc = subprocess.Popen(
                call.argv, env=call.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        threading.Thread(target=self._supervise, args=(call, call.proc), daemon=True).start()

    def _supervise(self, call: FakeCall, proc: subprocess.Popen[bytes]) -> None:
        """Modal's side of a call: a failed attempt is retried in a fresh container while retries last."""
        code = proc.wait()
        with self._lock:
            if call.result is not None or call.proc is not proc:
                return
            if code == 0:
                call.result = ("success", 0)
            elif call.attempts <= call.max_retries:
                self._start(call)
            else:
                call.result = ("failure", RuntimeError(f"replica {call.rank} exited with status {code}"))

    def _end(self, call: FakeCall, result: tuple[str, Any]) -> None:
        with self._lock:
            if call.result is None:
                call.result = result
        if call.proc is not None and call.proc.poll() is None:
            os.killpg(call.proc.pid, signal.SIGTERM)
            call.proc.wait()

    def _entries(self, call: FakeCall) -> list[Any]:
        from modal.types import LogEntry

        data = call.log.read_text() if call.log.exists() else ""
        sizes = itertools.cycle([7, 23, 3, 64, 11])  # where the container's writes happened to fall
        entries, start = [], 0
        while start < len(data):
            end = start + next(sizes)
            entries.append(
                LogEntry(data[start:end], datetime.now(timezone.utc), "stdout", call.call_id, [call.app_id])
            )
            start = end
        return entries

    # --- the SDK objects --------------------------------------------------------------------------------

    def install(self, monkeypatch: Any) -> None:
        import modal
        from modal._logs_manager import FunctionCallLogsManager

        from composer_serverless.executors import modal_app

        fake = self
        shaped = self._shaped_as
        real_options = {name: getattr(modal_app, name).with_options for name in ("train_replica", "syncer")}
        real_from_dict = modal.Secret.from_dict

        class App:
            def __init__(self) -> None:
                self._app_id: str | None = None
                self._running = False

            @property
            def app_id(self) -> str | None:
                return self._app_id

            @contextmanager
            @shaped("App.run", modal.App.run)
            def run(self, *, detach: bool = False, name: str | None = None, **_: Any) -> Iterator[App]:
                from modal.exception import InvalidError

                if self._running:
                    raise InvalidError("App is already running and can't be started again.")
                fake._api("app.run")
                app = FakeApp(f"ap-{uuid.uuid4().hex[:12]}", name, detach)
                fake.apps[app.app_id] = app
                self._app_id, self._running = app.app_id, True
                try:
                    try:
                        yield self
                    except KeyboardInterrupt:  # modal's runner: the detached app keeps running
                        if not detach:
                            fake._stop(app)
                        return
                    if not detach:
                        fake._stop(app)
                finally:
                    self._running = False

        class Function:
            def __init__(self, name: str, options: dict[str, Any]) -> None:
                self.name = name
                self.options = options
                self.app_id: str | None = None  # the app it was hydrated in, at its first use

            @shaped("Function.spawn", modal.Function.spawn)
            def spawn(self, run_url: str, rank: int) -> Any:
                fake._point("spawn.before", rank)
                fake._api("spawn")
                if self.app_id is None:  # hydrated once, from the function of the app running now
                    if not fake_app._running:
                        from modal.exception import ExecutionError

                        raise ExecutionError(
                            "Function has not been hydrated with the metadata it needs to run"
                        )
                    self.app_id = fake_app.app_id
                app = fake.apps[self.app_id or ""]
                env = {
                    "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                    "PYTHONPATH": str(REPO),
                    "HOME": str(fake.logs_dir),
                    "OMP_NUM_THREADS": "1",
                    "AWS_EC2_METADATA_DISABLED": "true",
                    **self.options.get("env", {}),
                }
                if self.options.get("gpu"):  # a Modal container has the GPU it was given: the simulated one
                    env[SIMULATED_ENV] = "1"
                for secret in self.options.get("secrets", []):
                    env.update(fake.secret_values.get(id(secret), {}))
                call_id = f"fc-{uuid.uuid4().hex[:12]}"
                call = FakeCall(
                    call_id,
                    app.app_id,
                    rank,
                    fake.command(run_url, rank),
                    env,
                    fake.logs_dir / f"{call_id}.log",
                    self.options["retries"].max_retries,
                    self.name,
                )
                fake.calls[call_id] = call
                app.calls.append(call_id)
                fake._start(call)
                fake._point("spawn.created", rank)
                handle = FunctionCall(call_id)
                fake._point("spawn.returned", rank)
                return handle

        class Replica:
            def __init__(self, name: str) -> None:
                self.name = name

            def with_options(self, **options: Any) -> Function:
                real_options[self.name](**options)  # the real one checks the options (lazily, offline)
                fake.used.add("Function.with_options")
                fake.options.append({"function": self.name, **options})
                return Function(self.name, options)

        class Logs:
            def __init__(self, call: FakeCall) -> None:
                self._call = call

            @shaped("logs.fetch", FunctionCallLogsManager.fetch)
            def fetch(self, **_: Any) -> Iterator[Any]:
                fake._api("logs")
                yield from fake._entries(self._call)

            @shaped("logs.tail", FunctionCallLogsManager.tail)
            def tail(self, entries: int = 100, **_: Any) -> Iterator[Any]:
                fake._api("logs")
                yield from fake._entries(self._call)[-entries:]

            @shaped("logs.stream", FunctionCallLogsManager.stream)
            def stream(self, timeout: float | None = None) -> Iterator[Any]:
                fake._api("logs")
                given = 0
                while True:
                    done = self._call.result is not None
                    entries = fake._entries(self._call)
                    yield from entries[given:]
                    given = len(entries)
                    if done:
                        return
                    time.sleep(0.1)

        class FunctionCall:
            def __init__(self, call_id: str) -> None:
                self.object_id = call_id

            @classmethod
            @shaped("FunctionCall.from_id", modal.FunctionCall.from_id)
            def from_id(cls, call_id: str, client: Any = None) -> FunctionCall:
                return cls(call_id)

            def _call(self) -> FakeCall:
                from modal.exception import NotFoundError

                if self.object_id not in fake.calls:
                    raise NotFoundError(f"Function call {self.object_id} not found")
                return fake.calls[self.object_id]

            @shaped("FunctionCall.get", modal.FunctionCall.get)
            def get(self, timeout: float | None = None, *, index: int = 0) -> Any:
                fake._api("get")
                call = self._call()
                if call.result is None:
                    raise TimeoutError()
                return _process(*call.result)

            @shaped("FunctionCall.cancel", modal.FunctionCall.cancel)
            def cancel(self, terminate_containers: bool = False) -> None:
                fake._api("cancel")
                fake._end(self._call(), ("terminated", "Function call cancelled"))

            @property
            def logs(self) -> Logs:
                return Logs(self._call())

        class AppHandle:
            def __init__(self, app: FakeApp) -> None:
                self._app = app

            @shaped("App.stop", modal.App.stop)
            def stop(self, *, client: Any = None) -> None:
                fake._api("stop")
                fake._stop(self._app)

        @shaped("App.lookup", modal.App.lookup)
        def lookup(name: str, **_: Any) -> AppHandle:
            from modal.exception import NotFoundError

            fake._api("lookup")
            if name not in fake.apps:
                raise NotFoundError(f"App {name} not found")
            return AppHandle(fake.apps[name])

        class Client:
            @classmethod
            @shaped("Client.from_env", modal.Client.from_env)
            def from_env(cls, _override_config: Any = None) -> Client:
                return cls()

            @shaped("Client.hello", modal.Client.hello)
            def hello(self) -> None:
                fake._api("hello")

        def from_dict(env_dict: dict[str, str | None] = {}) -> Any:  # noqa: B006 - the real signature
            secret = real_from_dict(env_dict)
            fake.used.add("Secret.from_dict")
            fake.secret_values[id(secret)] = {k: v for k, v in env_dict.items() if v is not None}
            return secret

        fake_app = App()
        monkeypatch.setattr(modal_app, "app", fake_app)
        monkeypatch.setattr(modal_app, "train_replica", Replica("train_replica"))
        monkeypatch.setattr(modal_app, "syncer", Replica("syncer"))
        monkeypatch.setattr(modal.FunctionCall, "from_id", FunctionCall.from_id)
        monkeypatch.setattr(modal.App, "lookup", lookup)
        monkeypatch.setattr(modal.Client, "from_env", Client.from_env)
        monkeypatch.setattr(modal.Secret, "from_dict", from_dict)
        self._wrap_run_points(fake_app)

    def _wrap_run_points(self, app: Any) -> None:
        """Interrupt points around ``app.run``: before the app exists, once it exists, as its block is left."""
        fake = self
        run = app.run

        @contextmanager
        def with_points(**kwargs: Any) -> Iterator[Any]:
            rank = int((kwargs.get("name") or "replica -1").rsplit(" ", 1)[-1])
            fake._point("app.run", rank)
            with run(**kwargs) as running:
                fake._point("app.created", rank)
                yield running
                fake._point("app.exit", rank)

        app.run = with_points

    def _stop(self, app: FakeApp) -> None:
        app.stopped = True
        for call_id in app.calls:
            self._end(self.calls[call_id], ("terminated", "App was stopped"))


def _process(status: str, data: Any) -> Any:
    """A call's output through the real client's ``_process_result``, as ``FunctionCall.get`` returns or
    raises it."""
    from modal._serialization import serialize
    from modal._utils.function_utils import _process_result
    from modal_proto import api_pb2

    statuses = {
        "success": api_pb2.GenericResult.GENERIC_STATUS_SUCCESS,
        "failure": api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
        "terminated": api_pb2.GenericResult.GENERIC_STATUS_TERMINATED,
        "timeout": api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT,
    }
    if status in ("success", "failure"):
        result = api_pb2.GenericResult(status=statuses[status], data=serialize(data), exception=repr(data))
    else:
        result = api_pb2.GenericResult(status=statuses[status], exception=str(data))
    return asyncio.run(_process_result(result, api_pb2.DATA_FORMAT_PICKLE, None, None))


def interrupt_points(ranks: int) -> list[tuple[str, int]]:
    """Every (point, rank) of the spawn sequence of ``ranks`` replicas."""
    return [(point, rank) for rank in range(ranks) for point in SPAWN_POINTS]


def unrecorded_live_calls(fake: FakeModal, record: Any) -> list[str]:
    """The ids of the live calls ``launch.json`` does not name (by call id): what could bill unseen."""
    named = {h.backend_id for h in record.handles}
    return [c.call_id for c in fake.live() if c.call_id not in named]

"""A fake Hugging Face Jobs API on loopback that runs each job's command as a local process.

The real ``huggingface_hub`` client talks to it through ``HF_ENDPOINT``; it follows the wire contract in the
project's HF Jobs research notes (JobInfo JSON with ``Z`` dates and no ``endpoint`` key, SSE logs that replay
from the start on every connection and stay open until the process has exited, labelled listing, a 4xx for
cancelling a terminal job, a SCHEDULING phase before each job starts, ``{"error": ...}`` bodies that the
client shows as the server's message). What a real server also does now and then, tests can ask for:
``omit_once`` leaves a job out of the next listing that would show it, and ``refuse`` answers the next
requests to a route with an error status (401, 402, 403, 429 with ``Retry-After``, 5xx), and
``fail_after_creating`` answers a job creation with an error after creating the job. ``max_live`` is
the most jobs of one (run, rank) that were ever live (SCHEDULING or RUNNING) at once.

A job runs in a minimal "image" environment plus the job's ``environment`` and ``secrets`` and nothing of the
test process's environment, so a credential the executor forgot to pass is really missing in the replica.
A job of a GPU flavor runs on the simulated accelerator (``accelerator/simulated.py``): its machine has GPUs.
Every request is recorded, and so is every job spec, so tests can assert what the executor sent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from composer_serverless.accelerator import SIMULATED_ENV

TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")


def _now_z() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class FakeJob:
    id: str
    namespace: str
    spec: dict[str, Any]
    created_at: str
    events: list[dict[str, str]] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None
    started: bool = False
    eof: bool = False
    cancelled: bool = False

    @property
    def stage(self) -> tuple[str, str]:
        if self.cancelled:
            return "CANCELED", "cancelled by the user"
        if not self.started:
            return "SCHEDULING", "Waiting for hardware"
        if not self.eof:
            return "RUNNING", ""
        code = self.proc.returncode if self.proc is not None else -1
        return ("COMPLETED", "") if code == 0 else ("ERROR", f"exit code {code}")

    def info(self) -> dict[str, Any]:
        stage, message = self.stage
        spec = self.spec
        return {
            "id": self.id,
            "createdAt": self.created_at,
            "dockerImage": spec.get("dockerImage"),
            "command": spec["command"],
            "arguments": spec.get("arguments", []),
            "environment": spec.get("environment", {}),
            "secrets": {name: None for name in spec.get("secrets", {})},  # never echo a secret back
            "flavor": spec.get("flavor"),
            "labels": spec.get("labels", {}),
            "status": {"stage": stage, "message": message},
            "owner": {"id": "u1", "name": self.namespace, "type": "user"},
        }


class FakeHFJobs:
    """Serve the Jobs API on 127.0.0.1; ``hold`` decides which job specs never leave SCHEDULING."""

    def __init__(
        self, token: str, namespace: str, image_env: dict[str, str], scheduling_s: float = 0.2
    ) -> None:
        self.token = token
        self.namespace = namespace
        self.image_env = image_env
        self.scheduling_s = scheduling_s
        self.hold: Callable[[dict[str, Any]], bool] = lambda spec: False
        self.jobs: dict[str, FakeJob] = {}
        self.requests: list[tuple[str, str]] = []
        self.request_times: list[tuple[str, str, float]] = []
        # Jobs the next listing that would show one of them leaves out (once each)
        self.omitted: list[Callable[[FakeJob], bool]] = []
        self.refusals: list[
            tuple[str, str, int, dict[str, str]]
        ] = []  # (method, path prefix, status, headers)
        # (path prefix, status): job creations carried out, then answered with that status instead
        self.failed_after: list[tuple[str, int]] = []
        self.max_live: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHFJobs:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.kill_all()
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        self.kill_all()
        with self._lock:
            self.jobs.clear()
            self.requests.clear()
            self.request_times.clear()
            self.omitted.clear()
            self.refusals.clear()
            self.failed_after.clear()
            self.max_live.clear()
        self.hold = lambda spec: False

    def omit_once(self, which: Callable[[FakeJob], bool], listings: int = 1) -> None:
        """The next ``listings`` listings that show a job ``which`` picks leave it out (the Hub's listings
        are not always complete); later listings show it again."""
        self.omitted += [which] * listings

    def refuse(
        self,
        method: str,
        path_prefix: str,
        status: int,
        times: int = 1,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer the next ``times`` ``method`` requests whose path starts with ``path_prefix`` with ``status``."""
        self.refusals += [(method, path_prefix, status, headers or {})] * times

    def fail_after_creating(self, path_prefix: str, status: int, times: int = 1) -> None:
        """Create the job of each of the next ``times`` creations whose path starts with ``path_prefix``, then
        answer ``status`` instead of it (a gateway that gave up waiting while the server went on: the job
        exists, and the client sees a 504)."""
        self.failed_after += [(path_prefix, status)] * times

    def live_jobs(self) -> list[FakeJob]:
        return [job for job in self.jobs.values() if job.stage[0] in ("SCHEDULING", "RUNNING")]

    def _count_live(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for job in self.live_jobs():
            labels = job.spec.get("labels", {})
            key = (labels.get("run_id", ""), labels.get("rank", ""))
            counts[key] = counts.get(key, 0) + 1
        for key, count in counts.items():
            self.max_live[key] = max(self.max_live.get(key, 0), count)

    def kill_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.proc is not None and job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()

    def requests_to(self, method: str, path_prefix: str) -> list[str]:
        return [path for m, path in self.requests if m == method and path.startswith(path_prefix)]

    # --- jobs -----------------------------------------------------------------------------------------

    def _create(self, namespace: str, spec: dict[str, Any]) -> FakeJob:
        job = FakeJob(uuid.uuid4().hex[:24], namespace, spec, _now_z())
        with self._lock:
            self.jobs[job.id] = job
            self._count_live()
        if not self.hold(spec):
            threading.Timer(self.scheduling_s, self._run, args=(job,)).start()
        return job

    def _run(self, job: FakeJob) -> None:
        if job.cancelled:
            return
        env = {**self.image_env, **job.spec.get("environment", {}), **job.spec.get("secrets", {})}
        flavor = job.spec.get("flavor", "none")
        env.update(JOB_ID=job.id, ACCELERATOR=flavor)
        if not flavor.startswith("cpu-"):  # a GPU flavor's machine has its GPUs: here, the simulated one
            env[SIMULATED_ENV] = "1"
        job.events.append({"data": f"===== Job started at {_now_z()} =====", "timestamp": _now_z()})
        try:
            job.proc = subprocess.Popen(
                job.spec["command"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        except OSError as e:
            job.events.append({"data": f"cannot start: {e}", "timestamp": _now_z()})
            job.started = job.eof = True
            return
        job.started = True
        assert job.proc.stdout is not None
        for line in job.proc.stdout:
            job.events.append({"data": line.rstrip("\n"), "timestamp": _now_z()})
        job.proc.wait()
        job.eof = True

    def _cancel(self, job: FakeJob) -> bool:
        if job.stage[0] in TERMINAL:
            return False
        job.cancelled = True
        if job.proc is not None and job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGTERM)
        return True

    # --- HTTP -----------------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if self.headers.get("authorization") == f"Bearer {fake.token}":
                    return True
                self._json(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def _refused(self, method: str, path: str) -> bool:
                for refusal in fake.refusals:
                    wanted, prefix, status, headers = refusal
                    if wanted == method and path.startswith(prefix):
                        fake.refusals.remove(refusal)
                        self._json(status, {"error": f"refused by the test ({status})"}, headers)
                        return True
                return False

            def _route(self, method: str) -> None:
                parts = urlsplit(self.path)
                fake.requests.append((method, self.path))
                fake.request_times.append((method, self.path, time.monotonic()))
                with fake._lock:
                    fake._count_live()
                segments = [s for s in parts.path.split("/") if s]
                if parts.path == "/api/agent-harnesses":
                    return self._json(200, {"standardEnvVars": [], "harnesses": {}})
                if self._refused(method, parts.path):
                    return None
                if not self._authorised():
                    return None
                if parts.path == "/api/whoami-v2":
                    return self._json(200, {"type": "user", "id": "u1", "name": fake.namespace, "orgs": []})
                if segments[:2] != ["api", "jobs"] or len(segments) < 3 or segments[2] != fake.namespace:
                    return self._json(404, {"error": "not found"})
                namespace, rest = segments[2], segments[3:]
                if method == "POST" and not rest:
                    length = int(self.headers.get("Content-Length", 0))
                    job = fake._create(namespace, json.loads(self.rfile.read(length)))
                    for failure in fake.failed_after:
                        prefix, status = failure
                        if parts.path.startswith(prefix):
                            fake.failed_after.remove(failure)
                            return self._json(status, {"error": f"Gateway Timeout ({status})"})
                    return self._json(200, job.info())
                if method == "GET" and not rest:
                    return self._list(parse_qsl(parts.query))
                job = fake.jobs.get(rest[0])
                if job is None:
                    return self._json(404, {"error": "Job not found"})
                if method == "GET" and len(rest) == 1:
                    return self._json(200, job.info())
                if method == "GET" and rest[1:] == ["logs"]:
                    return self._logs(job, dict(parse_qsl(parts.query)).get("tail"))
                if method == "POST" and rest[1:] == ["cancel"]:
                    if fake._cancel(job):
                        return self._json(200, {})
                    return self._json(400, {"error": "a terminal Job cannot be canceled"})
                return self._json(404, {"error": "not found"})

            def _list(self, query: list[tuple[str, str]]) -> None:
                stages = {v for k, v in query if k == "stage"}
                labels = dict(v.split("=", 1) for k, v in query if k == "label")
                shown = [
                    job
                    for job in fake.jobs.values()
                    if (not stages or job.stage[0] in stages)
                    and all(job.spec.get("labels", {}).get(k) == v for k, v in labels.items())
                ]
                left_out = set()
                for which in list(fake.omitted):
                    picked = [job for job in shown if which(job) and job.id not in left_out]
                    if picked:
                        fake.omitted.remove(which)
                        left_out.add(picked[0].id)
                self._json(200, [job.info() for job in shown if job.id not in left_out])

            def _logs(self, job: FakeJob, tail: str | None) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                cursor = max(0, len(job.events) - int(tail)) if tail else 0
                while True:
                    while cursor < len(job.events):
                        self.wfile.write(f"data: {json.dumps(job.events[cursor])}\n\n".encode())
                        cursor += 1
                    self.wfile.flush()
                    ended = not job.started or job.eof or (job.cancelled and job.proc is None)
                    if ended and cursor >= len(job.events):  # hold the stream open until the process is done
                        return
                    time.sleep(0.1)

            def do_GET(self) -> None:  # noqa: N802
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

        return Handler

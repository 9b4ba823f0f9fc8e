"""A fake for the one seam between ``ModalExecutor`` and Modal's servers (``ModalCalls``).

It records every call, and runs each spawned replica as a local process, the way Modal would run the
function in a container: with a minimal "image" environment plus the request's env and the values of the
secrets it names (read from this environment, as the real seam builds its ``Secret``), and nothing else. So
a secret the executor forgot to request is really missing in the replica.

State lives on the class, so a second executor (``status`` or ``cancel`` "from another process") sees the
calls the first one spawned, as it would through Modal's servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from composer_serverless.executors.base import worker_argv
from composer_serverless.executors.modal import Spawned, SpawnRequest

REPO = Path(__file__).resolve().parents[2]


class FakeModalCalls:
    spawned: ClassVar[list[SpawnRequest]] = []
    polled: ClassVar[list[str]] = []
    cancelled: ClassVar[list[str]] = []
    procs: ClassVar[dict[str, subprocess.Popen[bytes]]] = {}
    logs_dir: ClassVar[Path] = Path("/tmp")

    @classmethod
    def reset(cls, logs_dir: Path) -> None:
        cls.kill_all()
        cls.spawned, cls.polled, cls.cancelled, cls.procs = [], [], [], {}
        cls.logs_dir = logs_dir

    @classmethod
    def kill_all(cls) -> None:
        for proc in cls.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def spawn(self, request: SpawnRequest) -> Spawned:
        self.spawned.append(request)
        image_env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "HOME": str(self.logs_dir),
            "OMP_NUM_THREADS": "1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        secrets = {name: os.environ[name] for name in request.secret_env}
        calls = {}
        for rank in request.ranks:
            call_id = f"fc-{uuid.uuid4().hex[:12]}"
            with open(self.logs_dir / f"{call_id}.log", "wb") as log:
                self.procs[call_id] = subprocess.Popen(
                    worker_argv(request.run_url, rank, sys.executable),
                    env={**image_env, **request.env, **secrets},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            calls[rank] = call_id
        return Spawned("ap-fake", calls)

    def poll(self, call_id: str) -> tuple[str, str]:
        self.polled.append(call_id)
        code = self.procs[call_id].poll()
        if call_id in self.cancelled:
            return "cancelled", "cancelled"
        if code is None:
            return "running", ""
        return ("succeeded", "") if code == 0 else ("failed", f"exit code {code}")

    def logs(self, call_id: str, follow: bool) -> Iterator[str]:
        while follow and self.procs[call_id].poll() is None:
            time.sleep(0.1)
        yield from (self.logs_dir / f"{call_id}.log").read_text().splitlines()

    def cancel(self, call_id: str) -> None:
        self.cancelled.append(call_id)
        proc = self.procs[call_id]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()

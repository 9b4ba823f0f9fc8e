"""Run untrusted Python (a sampled completion and its unit tests) in a subprocess: bounded time, no network.

A policy under RL writes whatever raises its reward, so its code runs in a child process that

- is killed, with everything it started, when ``timeout_s`` runs out (an infinite loop costs one timeout);
- cannot reach the network: where Linux lets an unprivileged process open a new network namespace
  (``unshare --net``), the child gets one with no interface but a down loopback; and in every case an audit
  hook installed before the completion runs refuses to create sockets, start processes or load native code
  through ctypes (so it cannot open a socket by another route either);
- gets limited memory and CPU time, an empty working directory and a minimal environment (no proxies, no
  credentials), and runs isolated from the user's site-packages (``python -I``).

This keeps a program from doing harm by accident or reaching out; it is not a boundary against code crafted
to escape a Python process or to forge the harness's report. Run replicas in containers (Modal, HF Jobs) for
that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MEMORY_LIMIT_BYTES = 1 << 30
# The report line is found by this prefix plus a per-run nonce, so ordinary prints of the program are ignored.
REPORT_PREFIX = "__sandbox_report__"

# Runs in the child. Reads {"code", "tests", "nonce", "memory", "cpu"} from stdin; sets its resource limits
# (here rather than in a preexec_fn, which is unsafe in a parent with threads), executes the code, then each
# test in a copy of the code's namespace, and prints one report line. The audit hook goes in before any
# untrusted code runs and cannot be removed afterwards (PEP 578).
_HARNESS = r"""
import json, resource, sys, traceback

_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.", "ctypes.")

def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")

job = json.loads(sys.stdin.read())
resource.setrlimit(resource.RLIMIT_AS, (job["memory"], job["memory"]))
resource.setrlimit(resource.RLIMIT_CPU, (job["cpu"], job["cpu"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.addaudithook(_guard)

def _failure(e):
    frame = traceback.extract_tb(e.__traceback__)[-1:]
    line = f" (line {frame[0].lineno})" if frame and frame[0].filename == "<solution>" else ""
    return (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) + line

results = []
namespace = {"__name__": "__main__"}
try:
    exec(compile(job["code"], "<solution>", "exec"), namespace)
except BaseException as e:
    failed = "the code failed: " + _failure(e)
    results = [{"test": test, "passed": False, "error": failed} for test in job["tests"]]
else:
    for test in job["tests"]:
        try:
            exec(compile(test, "<test>", "exec"), dict(namespace))
            results.append({"test": test, "passed": True, "error": None})
        except BaseException as e:
            results.append({"test": test, "passed": False, "error": _failure(e)})
sys.stdout.flush()
print(job["nonce"] + json.dumps(results), flush=True)
"""


@dataclass(frozen=True)
class TestResult:
    test: str
    passed: bool
    error: str | None


@dataclass(frozen=True)
class SandboxResult:
    """What a run of the code and its tests came to.

    Attributes:
        tests: one result per test, in order; empty if the run did not report (timeout, crash).
        timed_out: the child was killed after ``timeout_s``.
        error: why the run produced no report (timeout, crash, memory), else None.
    """

    tests: tuple[TestResult, ...]
    timed_out: bool = False
    error: str | None = None

    @property
    def passed_fraction(self) -> float:
        return sum(t.passed for t in self.tests) / len(self.tests) if self.tests else 0.0

    def first_failure(self) -> str | None:
        """A one-line description of the first failing test, or of why nothing ran; None if all passed."""
        if self.error is not None:
            return self.error
        failed = next((t for t in self.tests if not t.passed), None)
        return None if failed is None else f"{failed.test.strip()} -> {failed.error}"


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """True when ``unshare --user --net`` works here (Linux with unprivileged user namespaces)."""
    unshare = shutil.which("unshare")
    available = False
    if unshare is not None:
        try:
            probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
            available = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            available = False
    if not available:
        logger.info("no unprivileged network namespaces: only the audit hook keeps sandboxed code offline")
    return available


def run_tests(
    code: str, tests: tuple[str, ...] | list[str], *, timeout_s: float, network_namespace: bool | None = None
) -> SandboxResult:
    """Execute ``code``, then each of ``tests`` against its namespace, in a sandboxed child process.

    Args:
        code: the program under test (a completion).
        tests: Python snippets, usually asserts; each passes if it raises nothing.
        timeout_s: wall-clock limit for the whole child; it and its process group are killed after it.
        network_namespace: run the child in a new network namespace; None uses one whenever available.
            The audit hook that refuses sockets is installed either way.

    Returns:
        The per-test results, or why there are none.
    """
    if not tests:
        raise ValueError("run_tests needs at least one test")
    use_namespace = network_namespace_available() if network_namespace is None else network_namespace
    nonce = REPORT_PREFIX + os.urandom(8).hex()
    command = [sys.executable, "-I", "-c", _HARNESS]
    if use_namespace:
        command = [shutil.which("unshare") or "unshare", "-rn", *command]
    job = json.dumps(
        {
            "code": code,
            "tests": list(tests),
            "nonce": nonce,
            "memory": MEMORY_LIMIT_BYTES,
            "cpu": int(timeout_s) + 1,
        }
    )
    with tempfile.TemporaryDirectory(prefix="sandbox-") as cwd:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env={"PATH": os.defpath, "HOME": cwd, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(job.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return SandboxResult((), timed_out=True, error=f"timed out after {timeout_s:g}s")
    return _parse(stdout.decode(errors="replace"), stderr.decode(errors="replace"), proc.returncode, nonce)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _parse(stdout: str, stderr: str, returncode: int, nonce: str) -> SandboxResult:
    report = next((line for line in reversed(stdout.splitlines()) if line.startswith(nonce)), None)
    if report is None:
        last = stderr.strip().splitlines()[-1:] or [f"exit status {returncode}"]
        return SandboxResult((), error=f"the program did not finish: {last[0]}")
    rows = json.loads(report[len(nonce) :])
    return SandboxResult(tuple(TestResult(r["test"], r["passed"], r["error"]) for r in rows))

"""Run untrusted Python (a sampled completion and its unit tests, or a program the model runs as a tool) in a
subprocess: bounded time, no network.

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
# test in a copy of the code's namespace, and prints one report line, {"tests": [...], "error": ...}. Without
# tests it is a run: a raised error is printed as Python prints it (less the harness's frame) and its last line
# reported. The audit hook goes in before any untrusted code runs and cannot be removed afterwards (PEP 578).
# The report starts a line of its own, so output the program did not end with a newline cannot hide it.
_HARNESS = r"""
import json, linecache, resource, sys, traceback

_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.", "ctypes.")

def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")

job = json.loads(sys.stdin.read())
resource.setrlimit(resource.RLIMIT_AS, (job["memory"], job["memory"]))
resource.setrlimit(resource.RLIMIT_CPU, (job["cpu"], job["cpu"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
linecache.cache["<solution>"] = (len(job["code"]), None, job["code"].splitlines(True), "<solution>")
sys.addaudithook(_guard)

def _failure(e):
    frame = traceback.extract_tb(e.__traceback__)[-1:]
    line = f" (line {frame[0].lineno})" if frame and frame[0].filename == "<solution>" else ""
    return (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) + line

results = []
error = None
namespace = {"__name__": "__main__"}
try:
    exec(compile(job["code"], "<solution>", "exec"), namespace)
except BaseException as e:
    if job["tests"]:
        error = "the code failed: " + _failure(e)
    elif not (isinstance(e, SystemExit) and e.code in (None, 0)):  # a program may exit(0) when done
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        error = traceback.format_exception_only(type(e), e)[-1].strip()
if job["tests"] and error is not None:
    results = [{"test": test, "passed": False, "error": error} for test in job["tests"]]
elif job["tests"]:
    for test in job["tests"]:
        try:
            exec(compile(test, "<test>", "exec"), dict(namespace))
            results.append({"test": test, "passed": True, "error": None})
        except BaseException as e:
            results.append({"test": test, "passed": False, "error": _failure(e)})
sys.stdout.flush()
sys.stderr.flush()
print("\n" + job["nonce"] + json.dumps({"tests": results, "error": error}), flush=True)
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


@dataclass(frozen=True)
class ProgramResult:
    """What a run of a program came to (``run_program``).

    Attributes:
        stdout: what it printed.
        stderr: what it wrote to stderr, the traceback of an error it raised included.
        error: None when it ran to its end; else the last line of its traceback (``ZeroDivisionError: division
            by zero``), or why it did not finish (timeout, crash, memory).
        timed_out: the child was killed after ``timeout_s``.
    """

    stdout: str
    stderr: str
    error: str | None
    timed_out: bool = False


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
    ran = _run_child(code, list(tests), timeout_s, network_namespace)
    if isinstance(ran, ProgramResult):
        return SandboxResult((), timed_out=ran.timed_out, error=ran.error)
    _, report = ran
    return SandboxResult(tuple(TestResult(r["test"], r["passed"], r["error"]) for r in report["tests"]))


def run_program(code: str, *, timeout_s: float, network_namespace: bool | None = None) -> ProgramResult:
    """Execute ``code`` as a program in a sandboxed child process (the same limits as ``run_tests``): what
    it printed, and the last line of its traceback if it raised."""
    ran = _run_child(code, [], timeout_s, network_namespace)
    if isinstance(ran, ProgramResult):
        return ran
    (stdout, stderr), report = ran
    return ProgramResult(stdout, stderr, report["error"])


def _run_child(
    code: str, tests: list[str], timeout_s: float, network_namespace: bool | None
) -> tuple[tuple[str, str], dict] | ProgramResult:
    """The child's output (less its report) and report; a ``ProgramResult`` with the reason when it did not
    report (killed at the timeout, crashed, exited early)."""
    use_namespace = network_namespace_available() if network_namespace is None else network_namespace
    nonce = REPORT_PREFIX + os.urandom(8).hex()
    command = [sys.executable, "-I", "-c", _HARNESS]
    if use_namespace:
        command = [shutil.which("unshare") or "unshare", "-rn", *command]
    job = json.dumps(
        {
            "code": code,
            "tests": tests,
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
            out, err = proc.communicate(job.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out, err = _kill_group(proc)
            return ProgramResult(_text(out), _text(err), f"timed out after {timeout_s:g}s", timed_out=True)
    stdout, stderr = _text(out), _text(err)
    cut = stdout.rfind("\n" + nonce)
    if cut < 0:
        last = stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return ProgramResult(stdout, stderr, f"the program did not finish: {last[0]}")
    report = json.loads(stdout[cut + 1 + len(nonce) :].splitlines()[0])
    return (stdout[:cut], stderr), report


def _text(data: bytes | None) -> str:
    return (data or b"").decode(errors="replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """Kill the child and everything it started; what it had written."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()

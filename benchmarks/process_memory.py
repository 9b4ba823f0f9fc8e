"""This process's resident memory, as the memory benchmarks read it (Linux ``/proc``): the current size, the
high-water mark since the last reset, and the reset; and a worker run in a process of its own. Shared by
``loss_memory.py``, ``replica_memory.py`` and ``rollout_speed.py``, which run it from their own directory (a
script's directory is first on its path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

MMAP_THRESHOLD = 64 * 1024
"""glibc serves every allocation above this with mmap, so freed tensors leave the resident set at once instead of
lingering in malloc's heap (``MALLOC_MMAP_THRESHOLD_`` of a worker)."""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_worker(script: str, spec: dict) -> dict:
    """``script --worker SPEC`` in a fresh process (so peaks are not shared), with ``MMAP_THRESHOLD``: the JSON
    of its last output line; its stderr in the error if it fails."""
    done = subprocess.run(
        [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)],
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"worker {spec} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def start_peak(device: torch.device) -> int:
    """Start measuring a peak on ``device`` (all its work done first); returns the baseline to subtract from
    ``peak``. On a CPU the high-water mark is reset before the resident set is read, so memory freed in between
    cannot make the peak negative (as it did once in the suite)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    reset_hwm()
    return rss_bytes()


def peak(device: torch.device, baseline: int) -> int:
    """The peak since ``start_peak``, above its ``baseline``: CUDA's most allocated bytes, or the process's
    high-water mark. On a CPU never below 0: Linux counts each thread's resident pages lazily (synced every 64
    page faults), so a step that freed memory could read a few pages under the baseline (-16 KiB in a suite
    run), which no peak can be."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() - baseline
    return max(hwm_bytes() - baseline, 0)

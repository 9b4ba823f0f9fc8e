"""This process's resident memory, as the memory benchmarks read it (Linux ``/proc``): the current size, the
high-water mark since the last reset, and the reset. Shared by ``loss_memory.py`` and ``replica_memory.py``,
which run it from their own directory (a script's directory is first on its path)."""

from __future__ import annotations

import os


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

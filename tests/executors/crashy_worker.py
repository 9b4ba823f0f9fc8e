"""Test-only replica wrapper: crashes on purpose before anything else, then behaves like the real worker.

Reads its orders from the environment (never read by production code): ranks in ``CRASH_RANKS`` exit with
status 3 for their first ``CRASH_TIMES`` attempts, counted in files under ``CRASH_COUNT_DIR``. A crash comes
before the replica's first heartbeat and first sync, so the peers' fixed-participant exchange still completes
once the relaunched replica catches up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    rank = argv[argv.index("--rank") + 1]
    if rank in os.environ.get("CRASH_RANKS", "").split(","):
        counter = Path(os.environ["CRASH_COUNT_DIR"]) / f"rank-{rank}"
        crashes = int(counter.read_text()) if counter.exists() else 0
        if crashes < int(os.environ.get("CRASH_TIMES", "1")):
            counter.write_text(str(crashes + 1))
            print(f"crashy_worker: rank {rank} crashing on purpose (crash {crashes + 1})", flush=True)
            return 3
    from composer_serverless.replicas.worker import main as worker

    return worker(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One replica of a run, optionally through a FaultyStore: the test twin of ``replicas/worker.py``.

python replica_process.py --run URL --rank R [--faults '{"fraction": 0.2, "kill_on": "rounds/3/"}']
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from faults import FaultyStore

from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.trainer import run_replica


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--faults", help="FaultyStore keyword arguments as JSON")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    store = FaultyStore(args.run, **json.loads(args.faults)) if args.faults else ObjectStore(args.run)
    run_replica(store, args.rank)
    if isinstance(store, FaultyStore):
        print(f"injected {len(store.injected)} faults")
    return 0


if __name__ == "__main__":
    sys.exit(main())

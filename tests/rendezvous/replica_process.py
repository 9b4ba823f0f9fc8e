"""One replica of a run, optionally through a FaultyStore: the test twin of ``replicas/worker.py``, through
the same ``run_worker`` (a replica of several ranks opens a FaultyStore in each of them).

python replica_process.py --run URL --rank R [--faults '{"fraction": 0.2, "kill_on": "rounds/3/"}']
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys

from faults import FaultyStore

from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.worker import run_worker


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
    open_store = functools.partial(FaultyStore, **json.loads(args.faults)) if args.faults else ObjectStore
    return run_worker(args.run, args.rank, open_store)


if __name__ == "__main__":
    sys.exit(main())

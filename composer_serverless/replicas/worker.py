"""Replica entry point: ``python -m composer_serverless.replicas.worker --run URL --rank R``.

The same command runs on a laptop, in a Modal container and in an HF Job: everything else the replica needs
is in ``run.json`` inside the run, and credentials come from the environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.trainer import run_replica


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run", required=True, help="the run's store URL, e.g. s3://bucket/runs/abc or ./runs/abc"
    )
    parser.add_argument("--rank", required=True, type=int, help="this replica's rank, 0-based")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    run_replica(ObjectStore(args.run), args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())

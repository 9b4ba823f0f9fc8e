"""Syncer entry point: ``python -m composer_serverless.syncer --run URL``, started beside the learners.

Like a replica's worker, the same command runs anywhere: everything it needs is in ``run.json`` inside the
run, and the run key (``diloco.authenticate``) comes from its environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.syncer.syncer import run_syncer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="the run's store URL, e.g. s3://bucket/runs/abc")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    run_syncer(ObjectStore(args.run))
    return 0


if __name__ == "__main__":
    sys.exit(main())

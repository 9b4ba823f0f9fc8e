"""A script that launches a run through the library, as the benchmarks do: ``python -m
tests.executors.launch_script CONFIG``. No CLI around it, so no handler of the CLI's can be what cancels its
replicas on SIGTERM."""

from __future__ import annotations

import sys

from rich.console import Console

from composer_serverless.config import load_config
from composer_serverless.launch.launcher import launch

if __name__ == "__main__":
    launch(load_config(sys.argv[1]), sys.argv[1], Console(stderr=True))

"""Launch backends behind one protocol (see ``base.py``): local processes, Modal functions, HF Jobs.

Backends are imported when chosen, so a local run never imports a cloud SDK and a cloud SDK that is not
installed only matters to the runs that use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from composer_serverless.rendezvous import layout

if TYPE_CHECKING:
    from composer_serverless.config import RunConfig
    from composer_serverless.executors.base import ServerlessExecutor
    from composer_serverless.rendezvous.store import ObjectStore


def make_executor(config: RunConfig, run: ObjectStore) -> ServerlessExecutor:
    """The executor ``config.executor.type`` names, for the run at ``run``."""
    kind = config.executor.type
    if kind == "local":
        from composer_serverless.executors.local import LocalProcessExecutor

        log_dir = (
            run.local_dir(layout.LOGS) or Path(".composer-serverless") / (config.run_id or "run") / "logs"
        )
        return LocalProcessExecutor(run, log_dir)
    if kind == "modal":
        from composer_serverless.executors.modal import ModalExecutor

        return ModalExecutor(retry_s=config.executor.api_retry_s)
    if kind == "hf_jobs":
        from composer_serverless.executors.hf_jobs import HFJobsExecutor

        return HFJobsExecutor(retry_s=config.executor.api_retry_s)
    raise ValueError(f"unknown executor type {kind!r}")

"""The Modal App that runs replicas: one GPU function whose body is the replica worker, and one CPU function,
the decoupled syncer (called once per shard), whose body is the same worker.

It lives inside the package on purpose: Modal mounts the whole top-level package of a function defined in a
package, so containers get exactly the code that launched them. Module-level code runs again in every
container and therefore only builds lazy Modal objects (no network, no config, no arguments). The static
options below are safe defaults; each run overrides GPU, timeout, retries, secrets and environment with
``with_options`` (see ``executors/modal.py``). There is deliberately no ``max_containers``: a cap below the
number of replicas would queue some of them behind a sync barrier that waits for them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import modal

from composer_serverless.config.code import CODE_DIR_ENV
from composer_serverless.executors.modal_image import (
    APP_NAME,
    IMAGE_REQUIREMENTS,
    PYTHON_VERSION,
    REMOTE_CODE,
    RETRY_DELAY_S,
    SHIPMENT_ENV,
)
from composer_serverless.executors.runtime import TORCH_INDEX_URL, TORCH_REQUIREMENT

# The run's code and requirements (``shipment.py``), when the launcher imports this module for a run that
# ships some (``SHIPMENT_ENV``, read only while it does). In a container the module runs again without it:
# the image is already built, and its files are at REMOTE_CODE.
SHIPPED = json.loads(os.environ[SHIPMENT_ENV]) if modal.is_local() and SHIPMENT_ENV in os.environ else None


def replica_image(shipped: dict | None) -> modal.Image:
    """The replica image: the tested torch, the package's requirements, then the run's requirements and its
    code files (mounted last, as Modal requires of files added at container start)."""
    image = (
        modal.Image.debian_slim(python_version=PYTHON_VERSION)
        .pip_install(TORCH_REQUIREMENT, index_url=TORCH_INDEX_URL)  # the tested build, for the driver floor
        .pip_install(*IMAGE_REQUIREMENTS)
        .env({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    )
    if shipped is None:
        return image
    if shipped["requirements"]:
        image = image.pip_install(*shipped["requirements"])
    if shipped["code"]:
        image = image.env({CODE_DIR_ENV: REMOTE_CODE})
        for rel in shipped["code"]:
            image = image.add_local_file(Path(shipped["root"]) / rel, f"{REMOTE_CODE}/{rel}")
    return image


image = replica_image(SHIPPED)
app = modal.App(APP_NAME, image=image)


@app.function(
    gpu="H100",
    timeout=6 * 3600,
    retries=modal.Retries(max_retries=2, initial_delay=RETRY_DELAY_S, backoff_coefficient=1.0),
    single_use_containers=True,
)
def train_replica(run_url: str, rank: int) -> int:
    """Run replica ``rank`` of the run at ``run_url`` here; raises on failure, so Modal retries it (a
    returned value, whatever it is, is a success to Modal: a replica of several ranks reports a dead rank
    with its exit status, which is turned into an exception here)."""
    return _worker(run_url, rank, "replica")


@app.function(
    cpu=2.0,
    memory=8192,
    timeout=6 * 3600,
    retries=modal.Retries(max_retries=2, initial_delay=RETRY_DELAY_S, backoff_coefficient=1.0),
    single_use_containers=True,
)
def syncer(run_url: str, rank: int) -> int:
    """Run a shard of the decoupled syncer (``rank``, one of ``diloco.syncer_ranks`` of the run at
    ``run_url``; each shard is a call of its own) here: the same worker on a container without a GPU (it
    merges in host memory); raises on failure, so Modal retries it."""
    return _worker(run_url, rank, "the syncer, rank")


def _worker(run_url: str, rank: int, role: str) -> int:
    from composer_serverless.replicas.worker import main

    code = main(["--run", run_url, "--rank", str(rank)])
    if code != 0:
        raise RuntimeError(f"{role} {rank} exited with status {code} (its log says why)")
    return code

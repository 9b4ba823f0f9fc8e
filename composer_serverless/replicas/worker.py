"""Replica entry point: ``python -m composer_serverless.replicas.worker --run URL --rank R``.

In decoupled mode (``diloco.mode``) the ranks after the learners' (``diloco.syncer_ranks``, one per
``diloco.decoupled.syncer_shards``) are the syncer's shards (``syncer/syncer.py``): every backend starts,
watches, restarts and cancels each as it does a replica.

The same command runs on a laptop, in a Modal container and in an HF Job: everything else the replica needs
is in ``run.json`` inside the run, and credentials come from the environment.

A replica of G ranks (``RunConfig.ranks_per_replica``) is G processes started here with
``torch.multiprocessing.start_processes``, one per GPU (or CPU processes over gloo), joined by a process group
of their own. Not torch's elastic launcher: elastic restarts a failed rank inside the replica, while a rank of
a DiLoCo replica cannot rejoin its siblings mid-step (FSDP's collectives would hang). Here the death of any
rank ends the others and this process with an error, and the replica restarts whole, as a replica of one rank
does, from the store.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from composer_serverless.accelerator import SIMULATED_ENV
from composer_serverless.config import RunConfig
from composer_serverless.config.code import CODE_DIR_ENV
from composer_serverless.rendezvous import layout, shipped
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter

if TYPE_CHECKING:
    from composer_serverless.replicas.trainer import Replica

logger = logging.getLogger(__name__)

# How often a rank checks that the process that started it is still there.
ORPHAN_CHECK_S = 1.0
# Beyond the run's sync timeout, how long a rank may wait for its siblings in a collective: the lead may
# wait a whole sync_timeout_s for a round to be published while the others wait for its answer.
COLLECTIVE_SLACK_S = 600.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run", required=True, help="the run's store URL, e.g. s3://bucket/runs/abc or ./runs/abc"
    )
    parser.add_argument("--rank", required=True, type=int, help="this replica's rank, 0-based")
    args = parser.parse_args(argv)
    _configure_logging()
    return run_worker(args.run, args.rank, ObjectStore)


def run_worker(run_url: str, rank: int, open_store: Callable[[str], ObjectStore]) -> int:
    """Run replica ``rank`` with the store ``open_store(run_url)``: in this process, or as its G ranks.

    ``open_store`` must be picklable (a class or a module-level function): each rank opens its own store.
    """
    _simulate_if_asked()
    store = open_store(run_url)
    config = RunConfig.model_validate_json(store.get(layout.RUN_CONFIG))
    # The run's code, when it is shipped through the store, lives as long as this replica (its ranks too).
    with tempfile.TemporaryDirectory(prefix="composer-serverless-code-") as code:
        _fetch_code(store, config, rank, Path(code))
        return _run_ranks(run_url, rank, config, store, open_store)


def _fetch_code(store: ObjectStore, config: RunConfig, rank: int, into: Path) -> None:
    """Fetch the run's shipped code (HF Jobs), checked file by file, and tell the objective where it is
    (``CODE_DIR_ENV``, inherited by the ranks); nothing to do where it is in place or in the image."""
    from composer_serverless.rendezvous.runkey import run_key

    try:
        key = run_key(config.diloco)
        fetched = shipped.fetch(store, into, None if key is None else key.for_run(config.run_id or ""))
    except Exception as e:
        Reporter(store, rank).beat(state="failed", error=f"{type(e).__name__}: {e}")
        raise
    if fetched is not None:
        os.environ[CODE_DIR_ENV] = str(fetched)
        logger.info("replica %d: the run's code fetched from %s", rank, store.url_of(layout.CODE))


def _run_ranks(
    run_url: str, rank: int, config: RunConfig, store: ObjectStore, open_store: Callable[[str], ObjectStore]
) -> int:
    ranks = config.ranks_per_replica
    if rank in config.diloco.syncer_ranks:
        from composer_serverless.syncer.syncer import run_syncer

        run_syncer(store, shard=rank - config.diloco.replicas)
        return 0
    decoupled = config.diloco.mode == "decoupled"
    if ranks == 1:
        from composer_serverless.replicas.trainer import run_replica

        run_replica(store, rank, kind=_replica_kind(decoupled))
        return 0
    import torch.multiprocessing as mp

    timeout_s = config.diloco.sync_timeout_s + COLLECTIVE_SLACK_S
    with tempfile.TemporaryDirectory(prefix="composer-serverless-node-") as rendezvous:
        try:
            mp.start_processes(
                _rank_main,
                args=(
                    run_url,
                    rank,
                    ranks,
                    open_store,
                    f"{rendezvous}/store",
                    timeout_s,
                    os.getpid(),
                    decoupled,
                ),
                nprocs=ranks,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as e:  # with the rank's traceback, which it did not print itself
            logger.error(
                "replica %d: local rank %d failed; its other ranks were stopped\n%s",
                rank,
                e.error_index,
                e.msg,
            )
            return 1
        except mp.ProcessExitedException as e:
            # A rank killed from outside (kill -9, out of memory) wrote nothing; say so for the replica.
            why = f"local rank {e.error_index} exited with {e.exit_code}" + (
                f" (signal {e.signal_name})" if e.signal_name else ""
            )
            logger.error("replica %d: %s; its other ranks were stopped", rank, why)
            Reporter(store, rank).beat(state="failed", error=why)
            return 1
    return 0


def _rank_main(
    local_rank: int,
    run_url: str,
    rank: int,
    ranks: int,
    open_store: Callable[[str], ObjectStore],
    rendezvous: str,
    timeout_s: float,
    parent: int,
    decoupled: bool,
) -> None:
    """One rank of a replica (of a decoupled run's learner when ``decoupled``), in a process of its own."""
    import torch
    import torch.distributed as dist

    from composer_serverless.accelerator.device import replica_device
    from composer_serverless.replicas.node import Node
    from composer_serverless.replicas.trainer import run_replica

    _configure_logging()
    _simulate_if_asked()
    _exit_with(parent)
    device = replica_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        # NCCL where there is a real GPU; a simulated one keeps its tensors in host memory, which gloo moves
        "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo",
        init_method=f"file://{rendezvous}",
        rank=local_rank,
        world_size=ranks,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        node = Node(local_rank, ranks, dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
        run_replica(open_store(run_url), rank, node, kind=_replica_kind(decoupled))
    finally:
        dist.destroy_process_group()


def _replica_kind(decoupled: bool) -> type[Replica]:
    """What a replica runs: a decoupled run's learner, or lock-step's replica."""
    from composer_serverless.replicas.trainer import Replica

    if not decoupled:
        return Replica
    from composer_serverless.replicas.decoupled import DecoupledLearner

    return DecoupledLearner


def _exit_with(parent: int) -> None:
    """End this rank if the process that started it dies (kill -9 leaves no one to stop the ranks)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _simulate_if_asked() -> None:
    """Run this process on the simulated accelerator when its environment asks (the tests' GPU path)."""
    if os.environ.get(SIMULATED_ENV):
        from composer_serverless.accelerator import simulated

        simulated.install()
        logger.info("running on a simulated accelerator (%s is set)", SIMULATED_ENV)


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())

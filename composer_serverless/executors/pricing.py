"""The plan's cost estimate and the check that a replica's timeout covers its work.

The list prices behind the estimate are ``config.hardware``'s tables, which are also the hardware names the
config validates against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

from composer_serverless.config.base import ConfigError
from composer_serverless.executors.base import CostEstimate

if TYPE_CHECKING:
    from composer_serverless.config.run import RunConfig
    from composer_serverless.executors.measured import Measurement


def estimate_cost(
    config: RunConfig,
    *,
    price_per_replica_hour: float,
    price_basis: str,
    gpus_per_replica: int,
    of: Literal["replica", "syncer"] = "replica",
) -> CostEstimate:
    """The plan's cost: an upper bound from the timeout, and an expected figure when step time is known.
    ``of = "syncer"``: the decoupled syncer's, one machine per shard (``diloco.decoupled.syncer_shards``),
    each with the replicas' timeout and restarts and running as long as a learner does (it commits the last
    version when the learners' last contributions are in)."""
    ex = config.executor
    machines = _machines(config, of)
    max_hours = machines * (1 + ex.max_restarts) * ex.timeout_s / 3600
    cost = CostEstimate(
        price_per_replica_hour=price_per_replica_hour,
        price_basis=price_basis,
        gpus_per_replica=gpus_per_replica,
        max_replica_hours=round(max_hours, 4),
        max_usd=round(max_hours * price_per_replica_hour, 2),
        of=of,
        shards=1 if of == "replica" else machines,
    )
    if ex.seconds_per_step is None:
        return cost
    return _expected(cost, config, ex.seconds_per_step, "executor.seconds_per_step")


def with_measured(cost: CostEstimate, config: RunConfig, measurement: Measurement) -> CostEstimate:
    """``cost`` with the expected figure at a step time the project measured, unless the config gives its
    own (``executor.seconds_per_step``: the user's measurement of the user's hardware wins)."""
    if cost.expected_basis is not None:
        return cost
    return _expected(cost, config, measurement.seconds_per_step, measurement.source())


def _expected(cost: CostEstimate, config: RunConfig, seconds_per_step: float, basis: str) -> CostEstimate:
    dl = config.diloco
    hours = _machines(config, cost.of) * replica_seconds(config, seconds_per_step) / 3600
    if cost.of == "replica":
        learner = ""
    else:
        learner = (
            "as long as a learner: "
            if cost.shards == 1
            else f"{cost.shards} shards, each as long as a learner: "
        )
    return dataclasses.replace(
        cost,
        expected_replica_hours=round(hours, 4),
        expected_usd=round(hours * cost.price_per_replica_hour, 2),
        expected_basis=f"{learner}{dl.rounds} rounds x {dl.sync_every} steps x {seconds_per_step:g} s/step + "
        f"{config.executor.startup_s:g} s start-up per replica, {basis}",
    )


def _machines(config: RunConfig, of: Literal["replica", "syncer"]) -> int:
    return config.diloco.replicas if of == "replica" else len(config.diloco.syncer_ranks)


def replica_seconds(config: RunConfig, seconds_per_step: float) -> float:
    """Start-up plus every configured inner step at ``seconds_per_step``."""
    return config.executor.startup_s + config.diloco.rounds * config.diloco.sync_every * seconds_per_step


def expected_replica_seconds(config: RunConfig) -> float | None:
    """One replica's work at ``executor.seconds_per_step``; None when that is unknown."""
    ex = config.executor
    return None if ex.seconds_per_step is None else replica_seconds(config, ex.seconds_per_step)


def check_timeout_covers_work(config: RunConfig) -> None:
    """Refuse a timeout shorter than the work one replica is configured for (when the step time is known)."""
    needed = expected_replica_seconds(config)
    ex = config.executor
    if needed is None or ex.timeout_s >= needed:
        return
    dl = config.diloco
    raise ConfigError(
        f"executor.timeout_s ({ex.timeout_s} s) is shorter than the work one replica is configured for: "
        f"startup_s {ex.startup_s:g} s + {dl.rounds} rounds x {dl.sync_every} steps x "
        f"{ex.seconds_per_step:g} s/step = {needed:,.0f} s; the backend would stop every replica early\n"
        f"  fix: --set executor.timeout_s={math.ceil(needed * 1.5)} (50% headroom for syncs), "
        "or fewer diloco.rounds"
    )

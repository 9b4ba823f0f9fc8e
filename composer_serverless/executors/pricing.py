"""The plan's cost estimate and the check that a replica's timeout covers its work.

The list prices behind the estimate are ``config.hardware``'s tables, which are also the hardware names the
config validates against.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from composer_serverless.config.base import ConfigError
from composer_serverless.executors.base import CostEstimate

if TYPE_CHECKING:
    from composer_serverless.config.run import RunConfig


def estimate_cost(
    config: RunConfig, *, price_per_replica_hour: float, price_basis: str, gpus_per_replica: int
) -> CostEstimate:
    """The plan's cost: an upper bound from the timeout, and an expected figure when step time is known."""
    ex = config.executor
    replicas = config.diloco.replicas
    max_hours = replicas * (1 + ex.max_restarts) * ex.timeout_s / 3600
    expected_s = expected_replica_seconds(config)
    expected_hours = None if expected_s is None else replicas * expected_s / 3600
    return CostEstimate(
        price_per_replica_hour=price_per_replica_hour,
        price_basis=price_basis,
        gpus_per_replica=gpus_per_replica,
        max_replica_hours=round(max_hours, 4),
        max_usd=round(max_hours * price_per_replica_hour, 2),
        expected_replica_hours=None if expected_hours is None else round(expected_hours, 4),
        expected_usd=None if expected_hours is None else round(expected_hours * price_per_replica_hour, 2),
    )


def expected_replica_seconds(config: RunConfig) -> float | None:
    """Start-up plus every configured inner step at the measured step time; None when that is unknown."""
    ex = config.executor
    if ex.seconds_per_step is None:
        return None
    return ex.startup_s + config.diloco.rounds * config.diloco.sync_every * ex.seconds_per_step


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

"""What every replica's exchange is told (``ExchangeSettings``), what it reports (``ExchangeResult``) and how it
fails: the types ``allreduce.py`` and its callers (the manager, the trainer) share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from composer_serverless.rendezvous.codec import Codec
from composer_serverless.rendezvous.feedback import Residuals
from composer_serverless.rendezvous.runkey import RunKey


class ExchangeError(RuntimeError):
    """This replica could not complete the exchange (too few replicas, a timeout, missing shards)."""


class StaleRoundError(ExchangeError):
    """The store has already completed this round: this replica is behind and must not reopen it."""


@dataclass(frozen=True)
class ExchangeSettings:
    """What every replica of a run agrees on for its exchanges, and which local rank of its replica this
        exchange is for: with G ranks per replica, local rank l averages its part of the model with the l-th
        ranks of the others, and a replica takes part only once all G of its parts have arrived. With ``key`` (the
        run key) every payload is written with a MAC and read only with a valid one. With ``outlier_factor`` a
    contribution whose norm is more than that many times the median of the round's is left out."""

    replicas: int
    min_replicas: int
    codec: Codec
    timeout_s: float
    local_rank: int = 0
    local_ranks: int = 1
    key: RunKey | None = None
    # A contribution whose norm exceeds this many times the median of the round's is left out (robust.py).
    outlier_factor: float | None = None
    # The codec of the averages owners publish; None: ``codec`` (with the sparse codec: re-sparsified).
    reduced_codec: Codec | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be in [1, replicas={self.replicas}]")
        if not 0 <= self.local_rank < self.local_ranks:
            raise ValueError(f"local_rank ({self.local_rank}) must be in [0, local_ranks={self.local_ranks})")


@dataclass
class ExchangeResult:
    """The average and what producing it cost this replica."""

    average: torch.Tensor
    participants: list[int]
    bytes_up: int = 0
    bytes_down: int = 0
    waited_for_all_s: float | None = None
    upload_failed: bool = False
    rescued: list[int] = field(default_factory=list)
    # Per shard, the participants whose input went into its average (an input can be rejected).
    summed: dict[int, list[int]] = field(default_factory=dict)
    # With error feedback: what this replica's inputs left out of the pseudo-gradient plus residual it sent,
    # and (if it published its own shard's average) what that left out of the average plus its residual.
    residual: Residuals | None = None
    # With error feedback: the share of the squared norm of what this replica's inputs were to send that they
    # carried (``feedback.carried_share``).
    carried: float | None = None

    @property
    def contributors(self) -> list[int]:
        """The participants whose every input went into the average: the ones the round really averaged."""
        shards = [set(ranks) for ranks in self.summed.values()]
        return sorted(set(self.participants).intersection(*shards))

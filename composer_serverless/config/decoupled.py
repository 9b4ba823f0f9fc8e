"""The settings of ``diloco.mode = "decoupled"``: learners that never wait for one another and a syncer that
merges what has arrived (``composer_serverless/syncer``, docs/decoupled.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from composer_serverless.config.base import StrictModel


class DecoupledConfig(StrictModel):
    """How the syncer merges contributions and how far a learner may run ahead of the newest global."""

    min_quorum: int | None = Field(
        None,
        ge=1,
        description="contributions (each from a different learner) the syncer waits for before it merges; "
        "unset: every learner (diloco.replicas), the lock-step schedule",
    )
    grace_s: float | None = Field(
        0.0,
        ge=0,
        description="once min_quorum contributions are in, seconds the syncer waits for more learners' "
        "before it merges (a bound: it merges at once when every learner's is in); unset: no bound, it "
        "waits for every learner",
    )
    max_lag: int = Field(
        0,
        ge=0,
        description="contributions of a learner that may be unmerged when it starts its next round: 0 waits "
        "for the merge of its own contribution (lock-step's schedule, which makes decoupled mode with a full "
        "quorum equal lock-step bit for bit); 1 or more: it trains on while its contributions wait",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="a contribution whose learner started from a global this many versions or more older "
        "than the one it would be merged into is dropped (recorded as such, never merged); unset: none dropped",
    )
    adopt: Literal["keep", "overwrite"] = Field(
        "keep",
        description="what a learner does with the inner steps it ran since its last contribution when it "
        "adopts a newer global: 'keep' carries them over (new global + local progress since publishing), "
        "'overwrite' discards them. Identical with max_lag = 0 (nothing runs between publishing and adopting)",
    )
    weighting: Literal["equal"] = Field(
        "equal",
        description="how contributions are weighted in the merge: 'equal' (the lock-step mean). Token "
        "weighting arrives with the syncer's merge module",
    )
    average: Literal["mean"] = Field(
        "mean",
        description="how the weighted contributions are combined: 'mean' (the lock-step arithmetic). Radial-"
        "directional averaging arrives with the syncer's merge module",
    )
    outer: Literal["nesterov"] = Field(
        "nesterov",
        description="the syncer's outer optimizer: 'nesterov', SGD with diloco.outer_lr, outer_momentum and "
        "nesterov, as lock-step's. Delayed Nesterov arrives with the syncer's outer module",
    )
    poll_s: float = Field(
        0.5, gt=0, le=60, description="seconds between the syncer's (and a waiting learner's) store listings"
    )

    @model_validator(mode="after")
    def _staleness_above_lag(self) -> DecoupledConfig:
        if self.max_staleness is not None and self.max_staleness <= self.max_lag:
            raise ValueError(
                f"diloco.decoupled.max_staleness ({self.max_staleness}) must exceed max_lag ({self.max_lag}): a "
                "learner max_lag rounds ahead sends contributions that old, and every one would be dropped"
            )
        return self

"""The settings of ``diloco.mode = "decoupled"``: learners that never wait for one another and a syncer that
merges what has arrived (``composer_serverless/syncer``, docs/decoupled.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from composer_serverless.config.base import StrictModel

# Unset poll_s: a poll every hundredth of a round, between these bounds (before any step time is known: 0.5 s)
POLL_SHARE = 0.01
MIN_POLL_S, MAX_POLL_S, UNMEASURED_POLL_S = 0.05, 5.0, 0.5


class DecoupledConfig(StrictModel):
    """How the syncer merges contributions and how far a learner may run ahead of the newest global."""

    min_quorum: int | None = Field(
        None,
        ge=1,
        description="contributions (each from a different learner) the syncer waits for before it merges; "
        "unset: every learner (diloco.replicas), the lock-step schedule",
    )
    grace_s: float | None = Field(
        None,
        ge=0,
        description="once min_quorum contributions are in, the longest the syncer waits for more learners' "
        "before it merges (it merges at once when every learner's is in). With grace_gamma set, a bound on "
        "the adaptive window (unset: the window alone); with grace_gamma unset, the window itself (unset: "
        "no bound, it waits for every learner)",
    )
    grace_gamma: float | None = Field(
        0.5,
        ge=0,
        lt=1,
        description="the adaptive grace window (Decoupled DiLoCo): once min_quorum contributions are in, "
        "wait grace_gamma * slack, slack = tau * t_step - (t_quorum + t_sync), the time the learners' next "
        "inner steps hide beyond the quorum's wait (from the first contribution in hand) and the syncer's last "
        "merge and commit (tau = sync_every "
        "with max_lag >= 1; with max_lag 0 the learners wait for the merge, nothing is hidden, the window is "
        "0), bounded by grace_s. Below 1 so the wait stays inside the overlap; 0.5 keeps half of it as a "
        "margin for the estimates (t_step is the median of the quorum's contributions' seconds per step, "
        "t_sync the syncer's previous merge). Unset: the fixed window grace_s",
    )
    max_lag: int = Field(
        0,
        ge=0,
        description="contributions of a learner that may be unmerged when it starts its next round: 0 waits "
        "for the merge of its own contribution (lock-step's schedule, which makes decoupled mode with a full "
        "quorum equal lock-step bit for bit); 1 or more: it trains on while its contributions wait",
    )
    max_age: int | None = Field(
        8,
        ge=0,
        description="a contribution more than this many versions older than the global it would be merged "
        "into is dropped (recorded as such, never merged); unset: none dropped. 8 keeps every learner of the "
        "usual cases (syncer/merge.py)",
    )
    discount: float = Field(
        0.0,
        ge=0,
        description="a kept contribution of age a counts 1 / (1 + discount * a) times its weight; 0: no "
        "discount (Async Local-SGD found discounts barely help)",
    )
    adopt: Literal["keep", "overwrite"] = Field(
        "keep",
        description="what a learner does with the inner steps it has not sent yet when it adopts a newer "
        "global: 'keep' carries them over (new global + local progress since its last contribution, sent "
        "with its next one), 'overwrite' discards them (its next contribution counts only the steps after). "
        "They differ only when a learner adopts in the middle of its inner steps (adopt_when = 'arrival')",
    )
    adopt_when: Literal["publish", "arrival"] = Field(
        "arrival",
        description="when a learner adopts a newer global: 'arrival', at the first inner-step boundary after "
        "its lead has read the version, on a background thread, while it trained; 'publish', right after "
        "publishing each contribution (nothing unsent then). 'arrival' measured closer to lock-step's loss "
        "at equal tokens with no faults (docs/decoupled.md). With max_lag = 0 a learner waits for its own "
        "merge after each publish and adopts there either way",
    )
    align: bool = Field(
        True,
        description="keep the learners' rounds in step, as lock-step's are, without anyone waiting: a learner "
        "whose contribution the syncer held waiting for later ones (the version's held_s) lengthens the round "
        "in progress by that many seconds of its inner steps, so its next contribution arrives with theirs. "
        "With max_lag = 0 the learners wait for their merges and are in step already: nothing changes. "
        "Without it each learner keeps the phase its start gave it, and one that publishes early adopts "
        "every version late, a part of each round computed on the global before (measured: "
        "docs/decoupled.md)",
    )
    dynamic_steps: bool = Field(
        True,
        description="a learner slower than the fastest runs proportionally fewer inner steps per contribution, "
        "sync_every x (fastest seconds per step / its own), taken from each version it adopts (Async Local-"
        "SGD's dynamic local updates): its contributions arrive with the others' instead of every other "
        "merge, so the syncer's grace window is not spent waiting for it and none of its steps are computed "
        "on a global two versions old; the token weighting counts its fewer steps. With max_lag = 0 nothing "
        "changes (lock-step's schedule)",
    )
    weighting: Literal["tokens", "equal"] = Field(
        "tokens",
        description="how much a contribution counts in the merge: 'tokens', tokens ** 2 / steps (Decoupled "
        "DiLoCo's quantity times quality), or 'equal'. Equal weights (equal learners) merge with lock-step's "
        "arithmetic either way; the composer objective's tokens are its completions', which differ from "
        "learner to learner, so there only 'equal' is lock-step's plain average",
    )
    average: Literal["mean", "rda"] = Field(
        "mean",
        description="how the weighted contributions are combined per tensor: 'mean', or 'rda' (radial-"
        "directional: the weighted mean norm times the direction of the weighted mean of unit vectors; the "
        "embeddings are averaged plainly)",
    )
    outer: Literal["nesterov", "delayed_nesterov"] = Field(
        "nesterov",
        description="the syncer's outer optimizer: 'nesterov', SGD with diloco.outer_lr, outer_momentum and "
        "nesterov, as lock-step's; 'delayed_nesterov' (Async Local-SGD) counts contributions: a merge of k "
        "steps k / diloco.replicas of the way, and the momentum is updated once per diloco.replicas "
        "contributions merged (with every merge a mean of all learners', lock-step's Nesterov)",
    )
    keep_versions: int | None = Field(
        2,
        ge=1,
        description="global versions whose parameters and outer state the syncer keeps in the store after "
        "each merge (every version's small record is kept); contributions are deleted once a committed "
        "version has consumed them. 2: the newest, which learners, a restart, resume and the final's eval "
        "read, and the one before, for a reader that listed it just before a merge and for a fall-back when "
        "the newest is damaged (lock-step keeps two states for the same reasons). Unset: nothing is deleted, "
        "every version and contribution stays (benchmarks/goodput.py evaluates every version)",
    )
    syncer_shards: int = Field(
        1,
        ge=1,
        le=64,
        description="syncer processes, each merging one fragment of the global (contiguous groups of whole "
        "parameter tensors, balanced by size): each downloads its fragment of every contribution and "
        "uploads its fragment of every version, so a merge's bytes per syncer link are divided by this. "
        "One syncer's link carries every learner's upload (docs/decoupled.md, 'Traffic'): shard it when "
        "that link, not the learners', would be the run's bottleneck",
    )
    poll_s: float | None = Field(
        None,
        gt=0,
        le=60,
        description="seconds between the syncer's and the learners' store listings (the syncer's for "
        "contributions, a learner's reader's for new versions, a learner waiting for its merge). Unset: a "
        "hundredth of a round, sync_every x the seconds per inner step (the syncer's last merge's median, a "
        "learner's own), between 0.05 and 5 s, and 0.5 s until one is measured. Every poll's wait is latency "
        "in every round (the steps a learner trains before it adopts the version its contribution entered: "
        "measured, docs/decoupled.md), and every listing a request (on S3, $0.005 per 1,000 LISTs: about "
        "$0.0005 per round per process at a hundredth of a round, $0.36 an hour at the 0.05 s floor)",
    )

    def poll_every(self, sync_every: int, step_s: float | None) -> float:
        """The seconds between a process's listings: ``poll_s``, or unset a hundredth of a round of
        ``sync_every`` steps of ``step_s`` seconds (None: not measured yet), within the bounds."""
        if self.poll_s is not None:
            return self.poll_s
        if not step_s:
            return UNMEASURED_POLL_S
        return min(MAX_POLL_S, max(MIN_POLL_S, POLL_SHARE * sync_every * step_s))

    @model_validator(mode="after")
    def _age_covers_lag(self) -> DecoupledConfig:
        if self.max_age is not None and self.max_age < self.max_lag:
            raise ValueError(
                f"diloco.decoupled.max_age ({self.max_age}) must be at least max_lag ({self.max_lag}): a "
                "learner max_lag rounds ahead sends contributions that old, and every one would be dropped"
            )
        return self

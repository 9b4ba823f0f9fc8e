"""The run's schema: the model, the data, the inner and outer loops, evaluation, and ``RunConfig``, the tree
that holds them with the composer objective's table and the executor's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import fsspec
from pydantic import BaseModel, Field, field_validator, model_validator

from composer_serverless.config.base import StrictModel
from composer_serverless.config.code import CodeConfig
from composer_serverless.config.composer import ComposerConfig
from composer_serverless.config.data import DataConfig
from composer_serverless.config.decoupled import DecoupledConfig
from composer_serverless.config.executors import ExecutorConfig, HFJobsExecutorConfig, LocalExecutorConfig
from composer_serverless.config.harvest import HarvestConfig
from composer_serverless.config.model import ModelConfig
from composer_serverless.config.outputs import OutputConfig, TrackingConfig

RUN_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
STORE_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/*")
# Bounds past which a setting is a typo, not an experiment: every value is written to run.json and read by
# every replica, so it is refused here, before anything is written or paid for.
MAX_LR = 1.0
MAX_OUTER_LR = 10.0
MAX_ROUNDS = 1_000_000
MAX_SYNC_EVERY = 1_000_000
MAX_WAIT_S = 24 * 3600.0
# The composer objective's inner learning rate when unset: TRL's GRPOConfig default.
COMPOSER_LR = 1e-6


def _as_dict(value: Any) -> dict[str, Any]:
    """A table as a plain mapping, whether it came as TOML (a dict), a model, or not at all."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    return dict(value) if isinstance(value, dict) else {}


class TrainConfig(StrictModel):
    """The inner loop each replica runs between synchronisations."""

    objective: Literal["lm", "composer"] = Field(
        "lm",
        description="'lm': causal-LM cross-entropy (the DiLoCo papers' setting); 'composer': the "
        "three-channel loss GRPO + alpha * SDPO + beta * replay, configured in [composer]",
    )
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="inner optimizer")
    lr: float = Field(
        3e-3,
        gt=0,
        le=MAX_LR,
        description="peak inner learning rate (at most 1: beyond it any model diverges)",
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay (AdamW)")
    warmup_steps: int = Field(
        0, ge=0, description="linear warm-up of the inner learning rate, in inner steps"
    )
    schedule: Literal["constant", "cosine"] = Field(
        "cosine", description="inner learning-rate decay after warm-up"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the inner gradient norm; unset to disable")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="sequences per forward and backward (lm: rows of this rank's batch; composer: completions, "
        "and half as many preference pairs): the step's gradient accumulates over its micro-batches, equal to "
        "the whole batch's, and activation memory follows the micro-batch. Unset: the whole batch at once",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"both betas must be in [0, 1), got {list(betas)}")
        return betas


class DiLoCoConfig(StrictModel):
    """The outer loop: how many replicas, how often they sync, and the outer optimizer."""

    replicas: int = Field(4, ge=1, le=1024, description="number of replicas (M in the DiLoCo papers)")
    mode: Literal["lockstep", "decoupled"] = Field(
        "lockstep",
        description="'lockstep': every round is a barrier the replicas reach together (torchft's DiLoCo); "
        "'decoupled': learners never wait for one another, a syncer merges what has arrived "
        "(diloco.decoupled, docs/decoupled.md; the lm or the composer objective, every weight or LoRA's "
        "adapters, one rank per learner, no live harvest)",
    )
    decoupled: DecoupledConfig = Field(
        default_factory=DecoupledConfig, description="the syncer's and learners' settings in decoupled mode"
    )
    sync_every: int = Field(ge=1, le=MAX_SYNC_EVERY, description="inner steps between synchronisations (H)")
    rounds: int = Field(
        ge=1,
        le=MAX_ROUNDS,
        description="outer rounds to run; each replica runs rounds * sync_every inner steps",
    )
    # Measured (docs/RESULTS.md, section 1): with the embedding's rows combined over the replicas that trained
    # them, lr 0.7 and momentum 0.3 (a steady-state step of once the averaged pseudo-gradient) was the best
    # outer Nesterov step at H = 10; larger steps (0.9/0.3, 1.0/0.2, DiLoCo's 0.7/0.9 at seven times it)
    # ended further from data-parallel.
    outer_lr: float = Field(
        0.7, gt=0, le=MAX_OUTER_LR, description="outer SGD learning rate (0.7 in DiLoCo; at most 10)"
    )
    outer_momentum: float = Field(0.3, ge=0, lt=1, description="outer SGD momentum (0.9 in DiLoCo)")
    nesterov: bool = Field(True, description="Nesterov momentum for the outer step")
    fragments: int = Field(1, ge=1, description="Streaming DiLoCo fragments, synced one at a time")
    fragment_sync_delay: int = Field(
        0, ge=0, description="inner steps the sync overlaps (Streaming DiLoCo tau)"
    )
    fragment_update_alpha: float = Field(0.0, ge=0, le=1, description="mix of local into global after a sync")
    sync_timeout_s: float = Field(
        600.0,
        gt=0,
        le=MAX_WAIT_S,
        description="seconds one sync may take before this replica gives it up and rolls back (at most a day)",
    )
    store_outage_s: float = Field(
        300.0,
        ge=0,
        le=MAX_WAIT_S,
        description="seconds replicas and the launcher keep retrying a write the store refuses (full, "
        "read-only, access revoked) before they fail: an outage shorter than this costs only its length",
    )
    checkpoint_every: int = Field(
        10,
        ge=1,
        description="rounds between checkpoints (the global state and every replica's own state, where a "
        "resume starts; also the last round); they cost about 2/checkpoint_every of the fp32 exchange's bytes",
    )
    keep_checkpoints: int = Field(
        2,
        ge=2,
        le=1000,
        description="checkpoints kept in the store (older ones are deleted): a resume, or a run that rolls "
        "back by itself, falls back to the one before when the newest is damaged or missing",
    )
    outlier_norm_factor: float | None = Field(
        10.0,
        gt=1,
        description="leave out of a round any pseudo-gradient whose norm is more than this many times the "
        "lower median of the round's non-zero norms (with a quorum of at least 3), as a non-finite one is: a "
        "replica whose update "
        "blew up cannot end the run for everyone. Unset to average every finite contribution",
    )
    verify_global: bool = Field(
        True, description="record a digest of the global parameters after every round"
    )
    codec: Literal["fp32", "bf16", "int8", "sparse"] = Field(
        "fp32",
        description="wire format of pseudo-gradients: fp32, bf16, int8 with blockwise absmax scales, or sparse: "
        "per chunk of 4,096 values the top sparse_density of them, in 2 bits each with 12-bit indices, the rest "
        "kept by each replica as an error-feedback residual and sent in later rounds (about 120-140 times fewer "
        "bytes than fp32 at 1.5 %; on the demo's 100 rounds it trains well behind fp32, docs/RESULTS.md "
        "section 17: for long runs, where int8 is not small enough)",
    )
    sparse_density: float = Field(
        0.015,
        gt=0,
        le=0.25,
        description="with codec 'sparse': the fraction of each chunk's values a pseudo-gradient sends",
    )
    error_feedback: Literal["resend", "reset"] = Field(
        "resend",
        description="with codec 'sparse', where what a replica's input left out waits: 'resend' adds it to the "
        "next pseudo-gradient (the local weights restart from the global ones); 'reset' keeps it in the local "
        "weights (they restart from the global ones minus it). Measured on the demo (docs/RESULTS.md section "
        "17): 'reset' 14 % above fp32 at H = 10 against 22 %, but worse than its start at H = 50 where "
        "'resend' is 33 % above",
    )
    reduced_codec: Literal["fp32", "bf16", "int8", "sparse"] | None = Field(
        None,
        description="wire format of the averages the shard owners publish; unset: the codec's (with 'sparse', "
        "the average re-sparsified, so every object of a sync is the sparse size)",
    )
    embedding_average: Literal["touched", "all"] = Field(
        "touched",
        description="how the rows of the embedding (and of an untied output head) are averaged: 'touched' "
        "combines each token's row over the replicas whose training data held that token since the last sync, "
        "as far as one process on all their batches would have moved it (a plain average divides a rare "
        "token's step by the replicas that never saw it); 'all' averages every replica's row. A bit per row "
        "and step (at most 64 per sync) travels with each pseudo-gradient",
    )
    min_replicas: int = Field(
        1, ge=1, description="fewest replicas a sync may average once the straggler grace has passed"
    )
    authenticate: bool = Field(
        False,
        description="authenticate the exchange: the launcher makes a secret run key, delivers it to the "
        "replicas as a secret, and every pseudo-gradient payload and published state carries a keyed MAC; "
        "anything without a valid one is rejected, so a writer with access to the store but not the key can "
        "get no values averaged or loaded (the harvested pairs under harvest/ are not covered). The key is kept in ~/.config/composer-serverless/keys/ for resume",
    )
    transfer_concurrency: int = Field(
        8,
        ge=1,
        le=64,
        description="requests each replica process has in flight at once when it moves its shards (object "
        "stores give each connection a fraction of their bandwidth and scale with parallel requests)",
    )
    transfer_part_mb: int = Field(
        8,
        ge=5,
        le=5120,
        description="on S3, objects larger than this many MiB move in parts of this size: multipart uploads "
        "and ranged reads, in parallel (S3's smallest part is 5 MiB, its largest 5 GiB)",
    )
    quorum_grace_min_s: float = Field(
        1.0, ge=0, description="shortest wait for stragglers after a replica arrives at a sync, in seconds"
    )
    quorum_grace_max_s: float = Field(
        60.0,
        gt=0,
        description="longest wait for stragglers (also the wait before any arrival has been observed)",
    )
    quorum_grace_mads: float = Field(
        4.0, ge=0, description="straggler wait = median + this many scaled MADs of recent full-arrival waits"
    )
    max_failed_syncs: int = Field(
        3,
        ge=1,
        description="failed syncs in a row after which a replica stops (its restart resumes from the store)",
    )

    @property
    def syncer_ranks(self) -> range:
        """In decoupled mode the syncer's shards are started as the ranks after the learners' (the executors
        start, watch, restart and cancel each as they do a replica): ``decoupled.syncer_shards`` of them, shard
        k as rank ``replicas + k``. Empty in lock-step mode, which has no syncer."""
        if self.mode != "decoupled":
            return range(0)
        return range(self.replicas, self.replicas + self.decoupled.syncer_shards)

    @model_validator(mode="after")
    def _consistent_schedule(self) -> DiLoCoConfig:
        if self.sync_every % self.fragments:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be a multiple of fragments ({self.fragments}): "
                "each fragment syncs every sync_every/fragments steps"
            )
        per_fragment = self.sync_every // self.fragments
        if self.fragment_sync_delay >= per_fragment:
            raise ValueError(
                f"fragment_sync_delay ({self.fragment_sync_delay}) must be below sync_every/fragments "
                f"({per_fragment}): a fragment must land before it is sent again"
            )
        if self.min_replicas > self.replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) cannot exceed replicas ({self.replicas})")
        if self.quorum_grace_min_s > self.quorum_grace_max_s:
            raise ValueError(
                f"quorum_grace_min_s ({self.quorum_grace_min_s}) cannot exceed quorum_grace_max_s ({self.quorum_grace_max_s})"
            )
        if self.quorum_grace_max_s >= self.sync_timeout_s:
            raise ValueError(
                f"quorum_grace_max_s ({self.quorum_grace_max_s}) must be below sync_timeout_s ({self.sync_timeout_s}): "
                "a sync must be able to form its quorum before it times out"
            )
        if self.mode == "decoupled":
            self._decoupled_supported()
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov = true needs outer_momentum > 0; set nesterov = false for plain SGD")
        if self.codec == "sparse" and self.error_feedback == "reset" and self.fragment_update_alpha > 0:
            # Reset keeps the unsent residual as local = global - residual; the merge then mixes the pre-sync
            # local weights back in, so the next pseudo-gradient carries only part of the residual, plus the
            # progress the sync already sent.
            raise ValueError(
                f"error_feedback = 'reset' keeps what the sparse inputs left out in the local weights (local = "
                f"global - residual), and fragment_update_alpha = {self.fragment_update_alpha} mixes the "
                "pre-sync local weights back into them, so part of the residual would be lost and part of the "
                "sent progress sent again; set fragment_update_alpha = 0, or error_feedback = 'resend'"
            )
        return self

    def _decoupled_supported(self) -> None:
        """Refuse what decoupled mode does not do yet, each with the setting to change."""
        quorum = self.decoupled.min_quorum
        if quorum is not None and quorum > self.replicas:
            raise ValueError(
                f"diloco.decoupled.min_quorum ({quorum}) cannot exceed diloco.replicas ({self.replicas})"
            )
        refused = {
            "diloco.codec = 'sparse' (its residuals live in lock-step's exchange)": self.codec == "sparse",
            "diloco.reduced_codec = 'sparse'": self.reduced_codec == "sparse",
            "diloco.fragments > 1 (the syncer merges whole models)": self.fragments > 1,
            "diloco.fragment_update_alpha > 0": self.fragment_update_alpha > 0,
        }
        if self.decoupled.outer == "delayed_nesterov" and not (self.nesterov and self.outer_momentum > 0):
            raise ValueError(
                "diloco.decoupled.outer = 'delayed_nesterov' needs nesterov = true and outer_momentum > 0"
            )
        for name, on in refused.items():
            if on:
                raise ValueError(f"{name} is not supported with diloco.mode = 'decoupled' yet")


class EvalConfig(StrictModel):
    """Evaluation of the global model on the held-out files; how the composer objective decodes its held-out
    prompts (greedy by default, or n samples each, with pass@k)."""

    sequences: int = Field(
        64, ge=1, description="held-out sequences (lm) or held-out prompts (composer) scored per evaluation"
    )
    every_rounds: int = Field(1, ge=1, description="evaluate the global model every this many rounds")
    temperature: float = Field(
        0.0,
        ge=0,
        description="composer: 0 decodes each held-out prompt greedily; > 0 samples its completions at this "
        "temperature (the same seeds every evaluation, so the curve moves with the model, not the sampler)",
    )
    samples: int = Field(
        1,
        ge=1,
        le=1024,
        description="composer: completions per held-out prompt (TRL's num_generations_eval); eval/reward is "
        "their mean; more than 1 needs temperature > 0",
    )
    pass_at: tuple[int, ...] = Field(
        (),
        description="composer: the k of each pass@k reported beside the mean reward (eval/pass@k): the chance "
        "that at least one of k completions of a prompt passes, estimated without bias from all its samples "
        "(Chen et al. 2021); each k at most samples",
    )
    pass_threshold: float = Field(
        1.0, description="composer: reward at or above which a completion passes, for pass@k"
    )

    @model_validator(mode="after")
    def _samples_to_count(self) -> EvalConfig:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"samples = {self.samples} with greedy decoding (temperature = 0) scores one completion "
                f"{self.samples} times: set eval.temperature > 0 (1.0 samples as the model does) or samples = 1"
            )
        too_large = [k for k in self.pass_at if not 1 <= k <= self.samples]
        if too_large:
            raise ValueError(
                f"pass_at {list(self.pass_at)}: each k must be between 1 and samples ({self.samples}), since "
                f"pass@k takes k of a prompt's samples; raise eval.samples to at least {max(too_large)} or drop "
                f"{too_large}"
            )
        if len(set(self.pass_at)) != len(self.pass_at):
            raise ValueError(f"pass_at names a k twice: {list(self.pass_at)}")
        return self


class RunConfig(StrictModel):
    """Everything one training run needs; resolved to ``run.json`` and read by every replica."""

    run_id: str | None = Field(None, description="name of the run inside the store; generated when unset")
    store: str = Field(
        "runs", description="where runs live: a local directory, file://, s3://bucket/prefix, ..."
    )
    seed: int = Field(0, ge=0, description="seed for the model initialisation and the data order")
    model: ModelConfig
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    diloco: DiLoCoConfig
    eval: EvalConfig = EvalConfig()
    composer: ComposerConfig | None = Field(None, description="settings of train.objective = 'composer'")
    harvest: HarvestConfig | None = Field(
        None,
        description="teachers asked for preference pairs: by `composer-serverless harvest`, or between rounds "
        "with harvest.live",
    )
    executor: ExecutorConfig = LocalExecutorConfig()
    code: CodeConfig = Field(
        CodeConfig(), description="the user's code and packages shipped to every replica"
    )
    tracking: TrackingConfig = Field(
        TrackingConfig(), description="experiment trackers the launcher relays the run's metrics to"
    )
    output: OutputConfig = Field(OutputConfig(), description="the model pushed to the Hub when the run ends")

    @field_validator("store")
    @classmethod
    def _valid_store(cls, store: str) -> str:
        """A directory path or ``protocol://location``: ``s3:/bucket`` (one slash) would otherwise become a
        local directory named ``s3:``, and an empty store the current directory."""
        if not store.strip():
            raise ValueError(
                "the store is empty; use a directory (e.g. 'runs') or a URL like s3://bucket/runs"
            )
        scheme = STORE_SCHEME.match(store)
        if scheme is None:
            return store
        protocol = scheme.group(1).lower()
        if not store.startswith(f"{scheme.group(1)}://") or not store[len(scheme.group(0)) :].lstrip("/"):
            raise ValueError(
                f"{store!r} is not a store URL: write {protocol}://<bucket>/<prefix> (two slashes after "
                f"'{protocol}:'), or a directory path without a ':'"
            )
        if protocol not in fsspec.available_protocols():
            raise ValueError(
                f"{store!r}: unknown storage protocol {protocol!r} (fsspec knows s3, gcs, file, ...)"
            )
        return store

    @field_validator("run_id")
    @classmethod
    def _valid_run_id(cls, run_id: str | None) -> str | None:
        if run_id is not None and not RUN_ID_PATTERN.match(run_id):
            raise ValueError(
                f"{run_id!r} is not a valid run id: use 1-63 lowercase letters, digits and '-', "
                "starting with a letter or digit"
            )
        return run_id

    @model_validator(mode="before")
    @classmethod
    def _objective_defaults(cls, raw: Any) -> Any:
        """Defaults that depend on the objective: the composer objective's inner learning rate when unset
        (TRL's GRPOConfig, 1e-6: the lm default suits the tiny demo trained from scratch) and its replay
        weight (1 with pairs or a live harvest, else 0)."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        train = _as_dict(raw.get("train"))
        if train.get("objective") == "composer" and "lr" not in train:
            raw["train"] = {**train, "lr": COMPOSER_LR}
        composer = _as_dict(raw.get("composer"))
        if composer and composer.get("beta") is None:
            live = bool(_as_dict(raw.get("harvest")).get("live"))
            pairs = _as_dict(composer.get("data")).get("pairs") is not None
            raw["composer"] = {**composer, "beta": 1.0 if pairs or live else 0.0}
        return raw

    @model_validator(mode="after")
    def _composer_table_iff_composer_objective(self) -> RunConfig:
        if self.train.objective == "composer" and self.composer is None:
            raise ValueError("train.objective = 'composer' needs a [composer] table (its data and rewards)")
        if self.train.objective != "composer" and self.composer is not None:
            raise ValueError(
                f"[composer] is set but train.objective = {self.train.objective!r}; "
                "set train.objective = 'composer'"
            )
        return self

    @model_validator(mode="after")
    def _sampled_evaluation_is_the_composers(self) -> RunConfig:
        sampling = ("temperature", "samples", "pass_at", "pass_threshold")
        given = [f"eval.{n}" for n in sampling if getattr(self.eval, n) != EvalConfig.model_fields[n].default]
        if given and self.train.objective != "composer":
            raise ValueError(
                f"{', '.join(given)} set how the composer objective decodes its held-out prompts; the "
                f"{self.train.objective!r} objective scores held-out loss: remove them"
            )
        return self

    @property
    def live_harvest(self) -> bool:
        """Whether the launcher harvests pairs between rounds (and the replicas record rollouts for it)."""
        return self.harvest is not None and self.harvest.live

    @model_validator(mode="after")
    def _replay_has_pairs(self) -> RunConfig:
        # Pairs with beta = 0 are allowed and left unread, so that a sweep or an ablation can switch the
        # channel off with one override.
        composer = self.composer
        if (
            composer is not None
            and composer.replay_on
            and composer.data.pairs is None
            and not self.live_harvest
        ):
            raise ValueError(
                "composer.beta > 0 needs preference pairs: set composer.data.pairs, or harvest them live "
                "([harvest] with live = true). composer.beta is the replay channel's weight: TRL's beta, "
                "the KL weight, is composer.grpo.kl here"
            )
        if self.live_harvest and (composer is None or not composer.replay_on):
            raise ValueError(
                "harvest.live feeds the replay channel: it needs train.objective = 'composer' with "
                "composer.beta > 0"
            )
        return self

    @model_validator(mode="after")
    def _live_lag_leaves_a_round(self) -> RunConfig:
        if not self.live_harvest or self.harvest is None:
            return self
        lag, rounds = self.harvest.live_lag, self.diloco.rounds
        if rounds - lag - 1 < 1:
            raise ValueError(
                f"harvest.live_lag = {lag} leaves no round to harvest in a run of {rounds} rounds: the pairs of "
                f"round k are taken at the end of round k + live_lag and replayed from the round after, so only "
                f"rounds 1 to rounds - live_lag - 1 are harvested. "
                + (f"Set harvest.live_lag to at most {rounds - 2}, or " if rounds >= 2 else "Set ")
                + f"diloco.rounds to at least {lag + 2}"
            )
        return self

    @model_validator(mode="after")
    def _teacher_keys_stay_here(self) -> RunConfig:
        if self.harvest is None:
            return self
        keys = {t.api_key_env for t in self.harvest.teachers if t.api_key_env}
        sent = sorted(keys & set(getattr(self.executor, "secrets", ())))
        if sent:
            raise ValueError(
                f"executor.secrets names {', '.join(sent)}, a harvest teacher's key: the launcher harvests, "
                "and replicas never need it; remove it from executor.secrets"
            )
        return self

    @model_validator(mode="after")
    def _fragments_fit_tiny_model(self) -> RunConfig:
        if self.diloco.fragments > 1 and self.model.tiny is not None:
            layers = self.model.tiny.num_layers
            if self.diloco.fragments > layers:
                raise ValueError(
                    f"diloco.fragments ({self.diloco.fragments}) exceeds model.tiny.num_layers ({layers})"
                )
        return self

    @property
    def ranks_per_replica(self) -> int:
        """G, the processes of one replica that shard the model (FSDP2): ``ranks_per_replica`` locally, every
        GPU of a replica's container or job in the cloud, so no GPU that is paid for sits idle."""
        executor = self.executor
        if isinstance(executor, LocalExecutorConfig):
            return executor.ranks_per_replica
        if isinstance(executor, HFJobsExecutorConfig):
            return max(1, executor.gpus)
        return executor.gpu_count

    @model_validator(mode="after")
    def _decoupled_learners_supported(self) -> RunConfig:
        """Decoupled mode's learners run the lm or the composer objective, every weight or LoRA's adapters, on
        one rank or several (FSDP). A live harvest is refused before anything is written: its schedule is
        lock-step's (the pairs of round k are taken at the end of round k + live_lag, decided once for the
        round's quorum), and versions have no quorum every learner ends together (docs/decoupled.md)."""
        if self.diloco.mode != "decoupled":
            return self
        refused = {
            "a live harvest (harvest.live; composer.record_rollouts and `composer-serverless harvest --run` "
            "afterwards work)": self.live_harvest,
        }
        for name, on in refused.items():
            if on:
                raise ValueError(
                    f"{name} is not supported with diloco.mode = 'decoupled' yet; use diloco.mode = 'lockstep'"
                )
        return self

    @model_validator(mode="after")
    def _ranks_fit_the_objective(self) -> RunConfig:
        ranks = self.ranks_per_replica
        if ranks == 1:
            return self
        where = (
            "executor.ranks_per_replica"
            if isinstance(self.executor, LocalExecutorConfig)
            else "the GPUs per replica (executor.gpu_count, or the flavor's GPUs)"
        )
        if self.composer is not None:
            self._composer_fits_ranks(ranks, where)
            return self
        if self.data.batch_size % ranks:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be a multiple of the {ranks} ranks per replica "
                f"({where}): each rank takes an equal share of the replica's batch"
            )
        return self

    def _composer_fits_ranks(self, ranks: int, where: str) -> None:
        """The composer objective on G ranks (``objectives.composer``): each rank samples and trains on an
        equal share of the replica's prompts and pairs, and every forward pass runs on all of them together
        (FSDP gathers each layer from every rank), so whatever would make one rank pass more often than
        another is refused here."""
        composer = self.composer
        assert composer is not None
        shares = {"composer.rollout.prompts_per_step": composer.rollout.prompts_per_step}
        if composer.replay_on:
            shares["composer.replay.pairs_per_step"] = composer.replay.pairs_per_step
        for name, value in shares.items():
            if value % ranks:
                raise ValueError(
                    f"{name} ({value}) must be a multiple of the {ranks} ranks per replica ({where}): each "
                    "rank takes an equal share of the replica's"
                )
        refused = {
            "composer.rollout.dynamic_sampling": composer.rollout.dynamic_sampling,
            "composer.grpo.kl > 0 without model.lora (a frozen copy of the whole model)": composer.grpo.kl > 0
            and self.model.lora is None,
            "composer.record_rollouts": composer.record_rollouts,
            "a live harvest (harvest.live)": self.live_harvest,
        }
        for name, on in refused.items():
            if on:
                raise ValueError(
                    f"{name} is not supported with {ranks} ranks per replica ({where}) yet: switch it off, "
                    "or use one GPU per replica and more replicas"
                )

    def resolved_json(self) -> str:
        """The JSON replicas read: every default filled in, so a run never depends on a later default change."""
        return self.model_dump_json(indent=2)

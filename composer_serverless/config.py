"""The one validated configuration tree, loaded from TOML and overridable from the command line.

Every field is checked before anything is launched or written, so a typo or an impossible value costs a
second, not a GPU-hour. The launcher resolves the tree to JSON (``run.json`` in the run) and replicas read
exactly that: the replicas never see the TOML file or the command line.
"""

from __future__ import annotations

import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

RUN_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODAL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
HF_NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# A stock PyTorch CUDA runtime image: the replicas then pip-install the package (executor.package) at start.
DEFAULT_HF_JOBS_IMAGE = "pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime"


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key and says how."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class TinyModelConfig(_Strict):
    """A small Llama-family model and a byte-level BPE tokenizer built offline from the demo corpus."""

    vocab_size: int = Field(
        2048, ge=300, le=65536, description="BPE vocabulary size (256 bytes + merges + specials)"
    )
    hidden_size: int = Field(128, ge=16, description="width of the residual stream")
    intermediate_size: int = Field(384, ge=16, description="width of the MLP")
    num_layers: int = Field(2, ge=1, description="decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (also key/value heads)")
    tokenizer_corpus_mb: float = Field(4.0, gt=0, description="MB of training text the tokenizer is fit on")
    tokenizer: Literal["bpe", "chars"] = Field(
        "bpe",
        description="'bpe': byte-level BPE fit on the demo corpus; 'chars': one token per character of "
        "alphabet, for tasks whose answers are a few characters",
    )
    alphabet: str | None = Field(
        None,
        description="'chars' only: the characters that get a token (others become <|unk|>); default "
        "printable ASCII. A small alphabet gives a fresh model a real chance of sampling a right answer",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        return self

    @model_validator(mode="after")
    def _chars_has_no_fitted_vocabulary(self) -> TinyModelConfig:
        # Compared with the defaults, not with model_fields_set: the resolved run.json spells every field out.
        fitted = [
            name
            for name in ("vocab_size", "tokenizer_corpus_mb")
            if getattr(self, name) != type(self).model_fields[name].default
        ]
        if self.tokenizer == "chars" and fitted:
            raise ValueError(
                "tokenizer = 'chars' takes its vocabulary from alphabet and is not fit on a corpus; "
                f"remove {', '.join(fitted)}"
            )
        if self.alphabet is not None:
            if self.tokenizer != "chars":
                raise ValueError("alphabet is the vocabulary of tokenizer = 'chars'; set that or remove it")
            repeated = sorted({c for c in self.alphabet if self.alphabet.count(c) > 1})
            if not self.alphabet or repeated:
                raise ValueError(f"alphabet must be non-empty, each character once (repeated: {repeated})")
        return self


class ModelConfig(_Strict):
    """Which causal LM to train: a Hugging Face hub id or local path, or a tiny model built offline."""

    path: str | None = Field(None, description="hub id or local directory loadable by from_pretrained")
    tiny: TinyModelConfig | None = Field(None, description="build a tiny model from the demo corpus instead")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype on the replicas")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a hub id or directory) or [model.tiny]")
        return self


class DataConfig(_Strict):
    """The text the causal-LM objective trains on, split by file into train and held-out sets.

    Each step reads a global batch of ``diloco.replicas * batch_size`` rows and replica r trains on its
    ``batch_size`` of them, so runs with the same global batch (N = 4 x 4 rows, N = 1 x 16) see the same
    tokens in the same order, and comparing them compares the method, not the data.
    """

    corpus: Literal["stdlib"] = Field(
        "stdlib", description="'stdlib': the Python standard library source of the running interpreter"
    )
    seq_len: int = Field(128, ge=8, le=32768, description="tokens per training sequence")
    batch_size: int = Field(8, ge=1, description="sequences per inner step on each replica")
    streams_per_row: int = Field(
        1,
        ge=1,
        le=64,
        description="files each batch row takes its sequences from in turn; 1 reads one file at a time, so "
        "for tens of steps a replica sees only batch_size files and replicas drift apart between syncs",
    )
    heldout_percent: float = Field(5.0, gt=0, lt=50, description="share of files held out for evaluation")


class TrainConfig(_Strict):
    """The inner loop each replica runs between synchronisations."""

    objective: Literal["lm", "composer"] = Field(
        "lm",
        description="'lm': causal-LM cross-entropy (the DiLoCo papers' setting); 'composer': the "
        "three-channel loss GRPO + alpha * SDPO + beta * replay, configured in [composer]",
    )
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="inner optimizer")
    lr: float = Field(3e-3, gt=0, description="peak inner learning rate")
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

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"both betas must be in [0, 1), got {list(betas)}")
        return betas


class DiLoCoConfig(_Strict):
    """The outer loop: how many replicas, how often they sync, and the outer optimizer."""

    replicas: int = Field(4, ge=1, le=1024, description="number of replicas (M in the DiLoCo papers)")
    sync_every: int = Field(ge=1, description="inner steps between synchronisations (H)")
    rounds: int = Field(
        ge=1, description="outer rounds to run; each replica runs rounds * sync_every inner steps"
    )
    outer_lr: float = Field(0.7, gt=0, description="outer SGD learning rate (0.7 in DiLoCo)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer SGD momentum (0.9 in DiLoCo)")
    nesterov: bool = Field(True, description="Nesterov momentum for the outer step")
    fragments: int = Field(1, ge=1, description="Streaming DiLoCo fragments, synced one at a time")
    fragment_sync_delay: int = Field(
        0, ge=0, description="inner steps the sync overlaps (Streaming DiLoCo tau)"
    )
    fragment_update_alpha: float = Field(0.0, ge=0, le=1, description="mix of local into global after a sync")
    sync_timeout_s: float = Field(
        600.0, gt=0, description="seconds one sync may take before this replica gives it up and rolls back"
    )
    verify_global: bool = Field(
        True, description="record a digest of the global parameters after every round"
    )
    codec: Literal["fp32", "bf16", "int8"] = Field(
        "fp32",
        description="wire format of pseudo-gradients: fp32, bf16, or int8 with blockwise absmax scales",
    )
    min_replicas: int = Field(
        1, ge=1, description="fewest replicas a sync may average once the straggler grace has passed"
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
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov = true needs outer_momentum > 0; set nesterov = false for plain SGD")
        return self


class EvalConfig(_Strict):
    """Evaluation of the global model on the held-out files."""

    sequences: int = Field(
        64, ge=1, description="held-out sequences (lm) or held-out prompts (composer) scored per evaluation"
    )
    every_rounds: int = Field(1, ge=1, description="evaluate the global model every this many rounds")


# --- the composer objective ---------------------------------------------------------------------------

BUILTIN_REWARDS = ("exact_match", "format", "unit_tests")
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class RewardConfig(_Strict):
    """One verifiable reward; a rollout's reward is the weighted sum of the configured rewards."""

    fn: str = Field(
        description="reward function: 'exact_match' (the record's answer), 'format' (a regex the whole "
        "completion must match), 'unit_tests' (the record's tests, run in a sandboxed subprocess) or "
        "'package.module:function'"
    )
    weight: float = Field(1.0, description="weight of this reward in the sum; negative for a penalty")
    pattern: str | None = Field(
        None, description="'format' only: the regular expression (Python re, fullmatch)"
    )
    timeout_s: float = Field(
        5.0, gt=0, description="'unit_tests' only: seconds before the test process is killed"
    )

    @field_validator("fn")
    @classmethod
    def _known_or_import_path(cls, fn: str) -> str:
        if fn not in BUILTIN_REWARDS and not IMPORT_PATH.match(fn):
            raise ValueError(
                f"{fn!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an import path "
                "'package.module:function'"
            )
        return fn

    @model_validator(mode="after")
    def _pattern_for_format_only(self) -> RewardConfig:
        if self.weight == 0:
            raise ValueError(f"reward {self.fn!r} has weight 0 and would only cost time; remove it")
        if (self.fn == "format") != (self.pattern is not None):
            raise ValueError("set pattern exactly when fn = 'format' (the regex the completion must match)")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {e}") from None
        return self


class RolloutConfig(_Strict):
    """How each replica samples from its current model every inner step."""

    group_size: int = Field(8, ge=2, description="G, completions sampled per prompt (the GRPO group)")
    prompts_per_step: int = Field(8, ge=1, description="prompts per inner step on each replica")
    max_new_tokens: int = Field(16, ge=1, description="generation limit per completion, EOS included")
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature; also the temperature of the GRPO and SDPO log-probs"
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: keep only groups whose rewards differ, drawing more prompts "
        "until prompts_per_step such groups are found or max_draws batches were drawn",
    )
    max_draws: int = Field(
        3, ge=1, description="dynamic sampling: prompt batches drawn at most per inner step"
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment: a completion longer than max_new_tokens - "
        "overlong_buffer tokens loses reward linearly, up to overlong_penalty at max_new_tokens; 0: off",
    )
    overlong_penalty: float = Field(1.0, gt=0, description="the largest overlong punishment (DAPO: 1)")

    @model_validator(mode="after")
    def _buffer_below_limit(self) -> RolloutConfig:
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be below max_new_tokens "
                f"({self.max_new_tokens}): completions up to max_new_tokens - overlong_buffer tokens are not "
                "punished"
            )
        return self


class GRPOChannelConfig(_Strict):
    """Channel 1, the policy gradient on verifiable rewards. Defaults: TRL 1.16 with DAPO's clip-higher."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="per-token normalisation: dapo (token mean, TRL default), grpo, bnpo or dr_grpo"
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="lower clip range of the importance ratio")
    eps_high: float = Field(0.28, ge=0, description="upper clip range (DAPO clip-higher: 0.28)")
    kl: float = Field(
        0.0, ge=0, description="weight of the k3 KL to the initial model; > 0 keeps a frozen copy of it"
    )
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="'group' divides advantages by the group std; 'none' only centres (Dr.GRPO)"
    )


class SDPOChannelConfig(_Strict):
    """Channel 2, self-distillation from the model's own hinted prediction (temperature: the rollout's)."""

    beta: float = Field(
        0.5, ge=0, le=1, description="generalized JSD: 0 is KL(teacher||student), 1 is KL(student||teacher)"
    )
    top_k: int | None = Field(
        None, ge=1, description="compare on the teacher's top-k tokens plus a tail bucket"
    )
    token_clip: float | None = Field(None, gt=0, description="cap on each token's divergence")


class ReplayChannelConfig(_Strict):
    """Channel 3, preference pairs replayed from frozen traces."""

    kind: Literal["dpo", "simpo"] = Field(
        "dpo",
        description="'dpo' (reference log-probs: from the file or computed once with the initial model) "
        "or 'simpo' (no reference)",
    )
    pairs_per_step: int = Field(8, ge=1, description="preference pairs per inner step on each replica")
    dpo_beta: float = Field(0.1, gt=0, description="DPO's beta (TRL default 0.1)")
    simpo_beta: float = Field(2.0, gt=0, description="SimPO's reward scale (the paper uses 2 to 10)")
    simpo_gamma: float = Field(
        0.5, ge=0, description="SimPO's target reward margin (the paper uses 0.3 to 1.6)"
    )


class HintConfig(_Strict):
    """How reward feedback becomes the SDPO teacher's prompt (templates after the SDPO reference code)."""

    template: str = Field(
        "{hint}\n{prompt}", description="the teacher's prompt; must contain {hint} and {prompt}"
    )
    solution: str = Field(
        "A correct answer: {solution}",
        description="how a successful sibling completion is shown ({solution})",
    )
    feedback: str = Field("{feedback}", description="how reward feedback is shown ({feedback})")
    use_solutions: bool = Field(
        True, description="show a rollout of the same group that succeeded (never the row's own completion)"
    )
    success_threshold: float = Field(
        1.0, description="reward at or above which a rollout counts as a solution"
    )

    @model_validator(mode="after")
    def _templates_have_their_fields(self) -> HintConfig:
        templates = {"template": ("hint", "prompt"), "solution": ("solution",), "feedback": ("feedback",)}
        for name, fields in templates.items():
            text = getattr(self, name)
            try:
                text.format(**{f: "" for f in fields})
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"{name} {text!r} may use only {{{'}, {'.join(fields)}}}: {e!r}") from None
            missing = [f for f in fields if "{" + f + "}" not in text]
            if missing:
                raise ValueError(f"{name} {text!r} must contain {', '.join('{' + f + '}' for f in missing)}")
        return self


class ComposerDataConfig(_Strict):
    """JSONL files read through fsspec (local paths, s3://, hf://, globs), sharded by rank."""

    prompts: str = Field(
        description="RL prompts for training: {prompt, answer?, tests?, hint?, task?, meta?} per line"
    )
    heldout: str = Field(description="RL prompts the global model is evaluated on (greedy decoding)")
    pairs: str | None = Field(
        None, description="preference pairs: {prompt, chosen, rejected, chosen_ref_logp?, rejected_ref_logp?}"
    )


class ComposerConfig(_Strict):
    """The objective `L_grpo + alpha * L_sdpo + beta * L_replay`, each inner step on fresh rollouts."""

    alpha: float = Field(
        1.0, ge=0, description="SDPO weight; 0 switches the channel and its teacher pass off"
    )
    beta: float = Field(
        0.0, ge=0, description="replay weight; 0 switches the channel off (> 0 needs data.pairs)"
    )
    data: ComposerDataConfig
    rewards: list[RewardConfig] = Field(
        min_length=1, description="the rewards summed into each rollout's reward"
    )
    rollout: RolloutConfig = Field(RolloutConfig(), description="sampling of the completions each step")
    grpo: GRPOChannelConfig = Field(GRPOChannelConfig(), description="channel 1, GRPO/DAPO")
    sdpo: SDPOChannelConfig = Field(SDPOChannelConfig(), description="channel 2, SDPO hint self-distillation")
    replay: ReplayChannelConfig = Field(
        ReplayChannelConfig(), description="channel 3, trace-replay DPO/SimPO"
    )
    hints: HintConfig = Field(HintConfig(), description="the SDPO teacher's hint, built from reward feedback")
    chunk_tokens: int = Field(256, ge=1, description="tokens per LM-head chunk in the loss")

    @model_validator(mode="after")
    def _replay_has_pairs(self) -> ComposerConfig:
        # The converse (pairs with beta = 0) is allowed and leaves the pairs unread, so that a sweep or an
        # ablation can switch the channel off with one override.
        if self.beta > 0 and self.data.pairs is None:
            raise ValueError("beta > 0 needs preference pairs: set composer.data.pairs")
        return self


class LocalExecutorConfig(_Strict):
    """Replicas as local subprocesses: the debugging backend."""

    type: Literal["local"] = "local"
    threads_per_replica: int | None = Field(
        None, ge=1, description="torch threads per replica; default shares the CPU cores evenly"
    )
    max_replicas: int = Field(
        32, ge=1, le=1024, description="most replicas this machine may run; a guard against a mistyped count"
    )
    max_restarts: int = Field(
        0,
        ge=0,
        le=10,
        description="times the launcher starts a dead replica again; 0 fails the run at the first death, "
        "which is what a local bug usually wants",
    )


class _CloudExecutorConfig(_Strict):
    """What every paid backend needs: a spend guard, a timeout covering the work, restarts, secrets."""

    max_replicas: int = Field(
        16, ge=1, le=1024, description="most replicas a launch may start (it caps the bill; raise on purpose)"
    )
    timeout_s: int = Field(
        6 * 3600,
        ge=60,
        description="seconds one replica attempt may run before the backend stops it (and its billing)",
    )
    max_restarts: int = Field(
        2, ge=0, le=10, description="times a dead or preempted replica is started again before the run fails"
    )
    seconds_per_step: float | None = Field(
        None,
        gt=0,
        description="measured seconds per inner step on this hardware; enables the expected-cost estimate "
        "and the check that timeout_s covers the configured steps",
    )
    startup_s: float = Field(
        300.0, ge=0, description="seconds a replica spends before its first step (image pull, model download)"
    )
    status_poll_s: float = Field(
        10.0,
        ge=0.1,
        description="seconds between status requests to the backend while watching (each is one API call); "
        "progress from the store updates every second regardless",
    )
    secrets: tuple[str, ...] = Field(
        (),
        description="extra environment variable names whose values reach the replicas as secrets "
        "(the store's and the Hub's credentials are added automatically)",
    )

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        bad = [n for n in names if not ENV_NAME_PATTERN.match(n)]
        if bad:
            raise ValueError(f"{bad} are not environment variable names (letters, digits, '_'; not values)")
        return names


class ModalExecutorConfig(_CloudExecutorConfig):
    """Replicas as Modal functions, one GPU container each, spawned in a detached app."""

    type: Literal["modal"] = "modal"
    gpu: str = Field("H100", description="Modal GPU type per replica, e.g. H100, A100-80GB, L40S")
    gpu_count: int = Field(1, ge=1, le=8, description="GPUs per replica container")
    timeout_s: int = Field(
        6 * 3600,
        ge=60,
        le=24 * 3600,
        description="seconds one replica attempt may run (Modal allows at most 24 h; its default of 300 s "
        "would kill any real run)",
    )
    modal_secrets: tuple[str, ...] = Field(
        (), description="names of secrets already stored in your Modal workspace to attach to every replica"
    )
    price_per_gpu_hour: float | None = Field(
        None, gt=0, description="USD per GPU-hour for the cost estimate; default is Modal's list price"
    )

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, gpu: str) -> str:
        from composer_serverless.executors.pricing import MODAL_GPU_PRICES

        return _known_name(gpu.upper(), MODAL_GPU_PRICES, "GPU type", hint="put the count in gpu_count")

    @field_validator("modal_secrets")
    @classmethod
    def _modal_secret_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        bad = [n for n in names if not MODAL_NAME_PATTERN.match(n)]
        if bad:
            raise ValueError(f"{bad} are not Modal secret names (letters, digits, '.', '_', '-'; < 64 chars)")
        return names


class HFJobsExecutorConfig(_CloudExecutorConfig):
    """Replicas as Hugging Face Jobs, one job per replica, labelled with the run and the rank."""

    type: Literal["hf_jobs"] = "hf_jobs"
    flavor: str = Field("a100-large", description="HF Jobs hardware flavor per replica, e.g. a100-large")
    image: str = Field(
        DEFAULT_HF_JOBS_IMAGE,
        min_length=1,
        description="public Docker image the replicas run in (a stock PyTorch image, or one built from "
        "deploy/hf_jobs/Dockerfile that already contains composer-serverless)",
    )
    package: str | None = Field(
        None,
        min_length=1,
        description="pip requirement installed in the image before the worker starts, e.g. "
        "'composer-serverless[s3,hf] @ https://github.com/you/composer-serverless/archive/<commit>.tar.gz'; "
        "unset when the image already contains the package",
    )
    namespace: str | None = Field(
        None,
        description="user or organisation the jobs run and bill under; unset: your token's user, found once",
    )
    timeout_s: int = Field(
        6 * 3600,
        ge=60,
        le=7 * 24 * 3600,
        description="seconds one replica job may run (HF Jobs' default, 30 minutes, cuts real runs short)",
    )
    scheduling_deadline_s: float = Field(
        1800.0,
        ge=1,
        description="seconds a replica may wait for hardware (SCHEDULING) before it is cancelled and the run "
        "goes on without it",
    )
    price_per_hour: float | None = Field(
        None, gt=0, description="USD per job-hour for the cost estimate; default is the flavor's list price"
    )

    @field_validator("flavor")
    @classmethod
    def _known_flavor(cls, flavor: str) -> str:
        from composer_serverless.executors.pricing import HF_FLAVOR_PRICES

        return _known_name(flavor.lower(), HF_FLAVOR_PRICES, "flavor")

    @field_validator("namespace")
    @classmethod
    def _namespace_name(cls, namespace: str | None) -> str | None:
        if namespace is not None and not HF_NAMESPACE_PATTERN.match(namespace):
            raise ValueError(f"{namespace!r} is not a Hugging Face user or organisation name")
        return namespace


def _known_name(name: str, known: dict[str, float], what: str, hint: str = "") -> str:
    if name in known:
        return name
    close = difflib.get_close_matches(name, list(known), n=1)
    suggestion = f"did you mean {close[0]!r}? " if close else ""
    extra = f"; {hint}" if hint and ":" in name else ""
    raise ValueError(f"unknown {what} {name!r}; {suggestion}known: {', '.join(known)}{extra}")


def _executor_type(value: Any) -> str:
    """The executor's ``type``; a table without one means the local backend."""
    return value.get("type", "local") if isinstance(value, dict) else getattr(value, "type", "local")


ExecutorConfig = Annotated[
    Annotated[LocalExecutorConfig, Tag("local")]
    | Annotated[ModalExecutorConfig, Tag("modal")]
    | Annotated[HFJobsExecutorConfig, Tag("hf_jobs")],
    Discriminator(_executor_type),
]
EXECUTOR_TYPES = ("local", "modal", "hf_jobs")


class RunConfig(_Strict):
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
    executor: ExecutorConfig = LocalExecutorConfig()

    @field_validator("run_id")
    @classmethod
    def _valid_run_id(cls, run_id: str | None) -> str | None:
        if run_id is not None and not RUN_ID_PATTERN.match(run_id):
            raise ValueError(
                f"{run_id!r} is not a valid run id: use 1-63 lowercase letters, digits and '-', "
                "starting with a letter or digit"
            )
        return run_id

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
    def _fragments_fit_tiny_model(self) -> RunConfig:
        if self.diloco.fragments > 1 and self.model.tiny is not None:
            layers = self.model.tiny.num_layers
            if self.diloco.fragments > layers:
                raise ValueError(
                    f"diloco.fragments ({self.diloco.fragments}) exceeds model.tiny.num_layers ({layers})"
                )
        return self

    def resolved_json(self) -> str:
        """The JSON replicas read: every default filled in, so a run never depends on a later default change."""
        return self.model_dump_json(indent=2)


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), executor_type: str | None = None
) -> RunConfig:
    """Read a TOML config, switch its executor if asked, apply ``dotted.key=value`` overrides, and validate.

    ``executor_type`` replaces the file's ``[executor]`` table when the file names another backend (its keys
    belong to that backend), and keeps it when the file already names this one; overrides come after, so
    ``--executor modal --set executor.gpu=A100-80GB`` works on any config.

    Raises:
        ConfigError: the file is missing or not TOML, an override is malformed, a key is unknown or a value
            is invalid. The message names every offending key and how to fix it.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}\n  fix: pass the path of a TOML file, e.g. deploy/configs/local-demo.toml"
        )
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    if executor_type is not None:
        select_executor(raw, executor_type)
    for override in overrides:
        apply_override(raw, override)
    return validate_config(raw, source=str(path))


def validate_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a raw config mapping, turning pydantic's errors into one actionable message."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, raw, source)) from None


def select_executor(raw: dict[str, Any], executor_type: str) -> None:
    """Make ``raw`` use the ``executor_type`` backend, dropping a table written for another backend."""
    if executor_type not in EXECUTOR_TYPES:
        choices = ", ".join(EXECUTOR_TYPES)
        raise ConfigError(f"--executor {executor_type!r}: unknown executor; choose one of {choices}")
    table = raw.get("executor")
    if not isinstance(table, dict) or table.get("type", "local") != executor_type:
        raw["executor"] = {"type": executor_type}


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``dotted.key=value`` in ``raw``; the value is read as a TOML value, else taken as a string."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {override!r}: expected dotted.key=value, e.g. --set diloco.replicas=2")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    node = raw
    *parents, leaf = key.split(".")
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {'.'.join(parents[: i + 1])} is a value, not a table")
        node = child
    node[leaf] = value


def _explain(error: ValidationError, raw: dict[str, Any], source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        key = _display_key(loc)
        if item["type"] == "extra_forbidden":
            known = sorted(_fields_at(loc[:-1]))
            close = difflib.get_close_matches(loc[-1], known, n=1)
            parent = _display_key(loc[:-1])
            suggestion = ".".join(filter(None, [parent, *close]))
            hint = f"did you mean {suggestion}?" if close else f"known keys here: {', '.join(known)}"
            lines.append(f"  {key}: unknown key; {hint}")
            continue
        if item["type"] == "union_tag_invalid":
            lines.append(
                f"  {key}.type: unknown {key} {item['ctx']['tag']!r}; choose one of {item['ctx']['expected_tags']}"
            )
            continue
        # --set cannot address an item of a list (e.g. train.channels.0.weight): point at the file only.
        settable = not any(p.isdigit() for p in loc)
        via_set = f" or pass --set {key}=<value>" if settable else ""
        if item["type"] == "missing":
            lines.append(f"  {key}: required but not set\n    fix: add it to {source}{via_set}")
            continue
        message = item["msg"].removeprefix("Value error, ")
        got = "" if isinstance(item.get("input"), dict) else f" (got {item['input']!r})"
        lines.append(f"  {key}: {message}{got}")
        description = _fields_at(loc[:-1]).get(loc[-1]) if loc else None
        if description:
            lines.append(f"    {key} is the {description}")
        if isinstance(item.get("input"), dict):
            lines.append(f"    fix: edit {_table_name(loc)} in {source}")
        else:
            lines.append(f"    fix: change {key} in {source}{via_set}")
    return "\n".join(lines)


def _table_name(loc: list[str]) -> str:
    """How a TOML file names the table at ``loc``: ``[train]``, or ``the 1st [[composer.rewards]]``."""
    shown = _display_key(loc).split(".")
    if shown[-1].isdigit():
        position = int(shown[-1]) + 1
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(position if position < 20 else position % 10, "th")
        return f"the {position}{suffix} [[{'.'.join(shown[:-1])}]] table"
    return f"the [{'.'.join(shown)}] table"


def _display_key(loc: list[str]) -> str:
    """The dotted key as the user writes it: without pydantic's union tags and validator names."""
    shown = [p for p in loc if not p.startswith("function-")]
    if len(shown) >= 3 and shown[0] == "executor":
        shown.pop(1)  # the discriminator tag pydantic inserts, e.g. executor.local.threads_per_replica
    return ".".join(shown) or "(top level)"


def _fields_at(loc: list[str]) -> dict[str, str | None]:
    """Field names (with descriptions) of the config table at ``loc``, following union tags."""
    candidates: list[type[BaseModel]] = [RunConfig]
    for part in loc:
        if part.startswith("function-") or part.isdigit():  # validator names, list indices
            continue
        tagged = [
            m for m in candidates if m.model_fields.get("type") and m.model_fields["type"].default == part
        ]
        if tagged:
            candidates = tagged
            continue
        field = next((m.model_fields[part] for m in candidates if part in m.model_fields), None)
        if field is None:
            return {}
        members = [_unannotated(a) for a in getattr(field.annotation, "__args__", (field.annotation,))]
        candidates = [a for a in members if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(candidates) != 1:
        return {}
    return {name: f.description for name, f in candidates[0].model_fields.items()}


def _unannotated(annotation: Any) -> Any:
    """``Annotated[X, ...]`` -> ``X``: union members carry their discriminator tag this way."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation

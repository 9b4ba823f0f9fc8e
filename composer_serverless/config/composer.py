"""The composer objective's schema: `L_grpo + alpha * L_sdpo + beta * L_replay`, its data, rewards, sampling
and the settings of each channel."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from composer_serverless.config.base import StrictModel

BUILTIN_REWARDS = ("exact_match", "format", "unit_tests")
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class RewardConfig(StrictModel):
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


class RolloutConfig(StrictModel):
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


class GRPOChannelConfig(StrictModel):
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


class SDPOChannelConfig(StrictModel):
    """Channel 2, self-distillation from the model's own hinted prediction (temperature: the rollout's)."""

    beta: float = Field(
        0.5, ge=0, le=1, description="generalized JSD: 0 is KL(teacher||student), 1 is KL(student||teacher)"
    )
    top_k: int | None = Field(
        None, ge=1, description="compare on the teacher's top-k tokens plus a tail bucket"
    )
    token_clip: float | None = Field(None, gt=0, description="cap on each token's divergence")


class ReplayChannelConfig(StrictModel):
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


class HintConfig(StrictModel):
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


class ComposerDataConfig(StrictModel):
    """JSONL files read through fsspec (local paths, s3://, hf://, globs), sharded by rank."""

    prompts: str = Field(
        description="RL prompts for training: {prompt, answer?, tests?, hint?, task?, meta?} per line"
    )
    heldout: str = Field(description="RL prompts the global model is evaluated on (greedy decoding)")
    pairs: str | None = Field(
        None,
        description="preference pairs: {prompt, chosen, rejected, chosen_ref_logp?, rejected_ref_logp?, "
        "provenance?}; with a live harvest, optional (the harvested pairs join them)",
    )


class ComposerConfig(StrictModel):
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
    chat_template: bool = Field(
        False,
        description="render every prompt (and the SDPO teacher's hinted prompt) as a user turn with the "
        "tokenizer's chat template, as an instruct model expects; false: the prompt text as it is",
    )
    record_rollouts: bool = Field(
        False,
        description="write each round's rollouts (prompt, sampled completion, reward) to the store, where "
        "`composer-serverless harvest` reads them (harvest.run); always on with a live harvest",
    )

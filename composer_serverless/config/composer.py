"""The composer objective's schema: `L_grpo + alpha * L_sdpo + beta * L_replay`, its data, rewards, sampling
and the settings of each channel."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from composer_serverless.config.base import StrictModel

BUILTIN_REWARDS = ("exact_match", "format", "unit_tests")
# The environments that ship with the package, named ``environment = "builtin:NAME"`` (environments/builtin.py).
BUILTIN_ENVIRONMENT = "builtin:"
BUILTIN_ENVIRONMENTS = ("code",)
# The column each built-in reads: a dataset none of whose rows has it cannot use that reward.
BUILTIN_COLUMNS = {"exact_match": "answer", "unit_tests": "tests"}
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
# A reward file as run.json names it, relative to code.root (``paths.py`` names it so, wherever it is on this
# machine): no absolute path, no way out of the root, so the shipped tree holds it.
FILE_PATH = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[^:]+\.py:[A-Za-z_]\w*$")
# The columns the built-ins and SDPO read, and the prompt: what a column map may rename.
MAPPED_COLUMNS = ("prompt", "answer", "tests", "hint", "task")


class RewardConfig(StrictModel):
    """One verifiable reward; a rollout's reward is the weighted sum of the configured rewards."""

    fn: str = Field(
        description="reward function: 'exact_match' (the answer column), 'format' (a regex the whole "
        "completion must match), 'unit_tests' (the tests column, run in a sandboxed subprocess), a file "
        "'my_task.py:function' (relative to the config file, anywhere on this machine; shipped to every "
        "replica), or an import path "
        "'package.module:function'; user functions have TRL's signature, fn(prompts, completions, "
        "completion_ids, **columns) -> list[float | None]"
    )
    name: str | None = Field(
        None, description="the reward's name in metrics; default: the function's name (or the built-in's)"
    )
    weight: float = Field(
        1.0,
        description="weight of this reward in the sum; negative for a penalty; 0 for an evaluation metric "
        "(computed and reported, in rollouts and the held-out evaluation, but no part of the advantage nor "
        "of SDPO's hints)",
    )
    pattern: str | None = Field(
        None, description="'format' only: the regular expression (Python re, fullmatch)"
    )
    timeout_s: float = Field(
        5.0, gt=0, description="'unit_tests' only: seconds before the test process is killed"
    )

    @field_validator("fn")
    @classmethod
    def _known_or_import_path(cls, fn: str) -> str:
        if fn not in BUILTIN_REWARDS and not IMPORT_PATH.match(fn) and not FILE_PATH.match(fn):
            raise ValueError(
                f"{fn!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}), a file "
                "'my_task.py:function' (relative to the config file, or absolute), nor an import path "
                "'package.module:function'"
            )
        return fn

    @model_validator(mode="after")
    def _pattern_for_format_only(self) -> RewardConfig:
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
    max_new_tokens: int = Field(
        256, ge=1, description="generation limit per completion, EOS included (TRL's max_completion_length)"
    )
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
    engine: Literal["auto", "reference", "static", "paged"] = Field(
        "auto",
        description="how completions are generated: reference (generate, dynamic cache), static (static cache, "
        "compiled with CUDA graphs on a GPU), paged (continuous batching, one prefill per prompt); auto: paged "
        "on a GPU, reference on a CPU (docs/RESULTS.md, rollout speed)",
    )
    engine_memory: float = Field(
        0.5,
        gt=0,
        le=0.9,
        description="paged engine: the largest share of the free device memory its KV cache takes while it "
        "generates (freed when it returns, before the backward pass)",
    )

    @model_validator(mode="after")
    def _buffer_below_limit(self) -> RolloutConfig:
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be below max_new_tokens "
                f"({self.max_new_tokens}): completions up to max_new_tokens - overlong_buffer tokens are not "
                "punished"
            )
        return self


class EpisodesConfig(StrictModel):
    """Multi-turn episodes against tools and an environment, TRL's conventions (``environments/``): the model
    writes a turn, its ``<tool_call>`` calls are answered as tool turns, until it answers without a call."""

    tools: tuple[str, ...] = Field(
        (),
        description="stateless tool functions, 'file.py:function' (relative to the config file) or "
        "'package.module:function'; their schemas come from type hints and docstrings (TRL's tools)",
    )
    environment: str | None = Field(
        None,
        description="an environment class, 'file.py:Class': one instance per episode, reset(**row) on the "
        "dataset row, its public methods are tools, get_reward() its own reward (TRL's environment_factory); "
        "or 'builtin:code', the built-in code environment: tools run_code (the program's stdout and stderr, "
        "run in the sandbox) and submit (runs the row's tests column, a list of Python snippets such as "
        "asserts, and ends the episode); its reward is the share of those tests that pass",
    )
    max_turns: int = Field(
        4, ge=1, description="model turns per episode at most (TRL's max_tool_calling_iterations + 1)"
    )
    max_tokens: int = Field(
        512, ge=1, description="tokens of an episode after its prompt at most, tool turns included"
    )
    tool_timeout_s: float = Field(
        30.0, gt=0, description="a tool call not answered within this ends its episode (reward 0)"
    )
    code_timeout_s: float = Field(
        5.0,
        gt=0,
        description="builtin:code only: seconds a run_code or submit program may run before the sandbox kills "
        "it (answered as a timeout, an error site); below tool_timeout_s, so the sandbox answers first",
    )
    environment_reward_weight: float = Field(
        1.0, description="the weight of the environment's get_reward() in the summed reward"
    )
    hint: str = Field(
        " Hint: {hint}",
        description="the text inserted at an error site for the SDPO teacher; {hint} is the tool's error or "
        "the environment's hint",
    )

    @field_validator("tools")
    @classmethod
    def _tool_paths(cls, tools: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in tools if not (FILE_PATH.match(t) or IMPORT_PATH.match(t))]
        if bad:
            raise ValueError(f"{bad}: name each tool 'file.py:function' or 'package.module:function'")
        return tools

    @field_validator("environment")
    @classmethod
    def _environment_path(cls, environment: str | None) -> str | None:
        if environment is not None and environment.startswith(BUILTIN_ENVIRONMENT):
            if environment.removeprefix(BUILTIN_ENVIRONMENT) not in BUILTIN_ENVIRONMENTS:
                known = ", ".join(BUILTIN_ENVIRONMENT + name for name in BUILTIN_ENVIRONMENTS)
                raise ValueError(f"{environment!r} is no built-in environment; the built-ins are: {known}")
            return environment
        if environment is not None and not (FILE_PATH.match(environment) or IMPORT_PATH.match(environment)):
            raise ValueError(f"{environment!r}: name the environment class 'file.py:Class'")
        return environment

    @model_validator(mode="after")
    def _something_to_call(self) -> EpisodesConfig:
        if not self.tools and self.environment is None:
            raise ValueError("episodes need tools, an environment, or both")
        if "{hint}" not in self.hint:
            raise ValueError("hint must hold {hint}, where the error's hint goes")
        if self.builtin is not None and self.tools:
            raise ValueError(
                f"{self.environment!r} brings its own tools: leave tools empty, or bring your own environment"
            )
        if self.builtin == "code" and self.code_timeout_s >= self.tool_timeout_s:
            raise ValueError(
                f"code_timeout_s ({self.code_timeout_s:g}) must be below tool_timeout_s "
                f"({self.tool_timeout_s:g}): the sandbox stops a program before the episode's tool call times out"
            )
        return self

    @property
    def builtin(self) -> str | None:
        """The built-in environment's name (``code`` for ``builtin:code``), None for the user's own."""
        if self.environment is None or not self.environment.startswith(BUILTIN_ENVIRONMENT):
            return None
        return self.environment.removeprefix(BUILTIN_ENVIRONMENT)

    @property
    def files(self) -> list[str]:
        """The user's files the tools and environment are in (shipped to every backend)."""
        specs = [*self.tools, *([self.environment] if self.environment else [])]
        return [s.rpartition(":")[0] for s in specs if FILE_PATH.match(s)]


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
    """Datasets as TRL takes them: JSONL or Parquet files through fsspec (local paths, s3://, hf://, globs),
    or a Hugging Face dataset (hf://datasets/OWNER/NAME, or a directory holding one), sharded by rank."""

    prompts: str = Field(
        description="RL prompts for training: a 'prompt' column (a string, or a list of {role, content} "
        "messages) and any others, every one passed to the rewards by name (answer, tests, hint and task "
        "are read by the built-ins, SDPO and evaluation)"
    )
    heldout: str = Field(
        description="RL prompts the global model is evaluated on (greedy decoding, or as [eval] samples)"
    )
    columns: dict[str, str] = Field(
        {},
        description="renames applied to every row first: our name = the dataset's column, e.g. "
        'prompt = "question" (names: prompt, answer, tests, hint, task)',
    )
    train_split: str = Field("train", description="the split of a Hugging Face dataset trained on")
    heldout_split: str = Field("test", description="the split of a Hugging Face dataset evaluated on")
    subset: str | None = Field(None, description="the configuration of a Hugging Face dataset (e.g. 'main')")
    pairs: str | None = Field(
        None,
        description="preference pairs: {prompt, chosen, rejected, chosen_ref_logp?, rejected_ref_logp?, "
        "provenance?}; with a live harvest, optional (the harvested pairs join them)",
    )

    @field_validator("columns")
    @classmethod
    def _known_targets(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(MAPPED_COLUMNS))
        if unknown:
            raise ValueError(
                f"columns may rename to {', '.join(MAPPED_COLUMNS)}; {unknown} are none of them (write our "
                "name = the dataset's column; other columns reach the rewards under their own names)"
            )
        return columns


class ComposerConfig(StrictModel):
    """The objective `L_grpo + alpha * L_sdpo + beta * L_replay`, each inner step on fresh rollouts.

    Defaults a TRL user expects (GRPOConfig, TRL 1.16): learning rate 1e-6 (``train.lr``, set by the objective
    when unset), temperature 1, 8 completions per prompt, no KL term; SDPO only when the task gives feedback to
    hint with, replay only when there are pairs. Not TRL's: 256 new tokens per completion (TRL's
    max_completion_length is 512), which a task with long reasoning raises (the GSM8K recipe does).
    """

    alpha: float | Literal["auto"] = Field(
        "auto",
        description="SDPO weight; 0 switches the channel and its teacher pass off. 'auto': 1 when the task "
        "gives feedback for hints (a reward returns feedback, as the built-ins do, or the prompts have a "
        "hint column), else 0; the launcher decides and run.json holds the number",
    )
    beta: float | None = Field(
        None,
        ge=0,
        description="replay weight; 0 switches the channel off (> 0 needs data.pairs or a live harvest); "
        "unset: 1 when there are pairs, else 0",
    )
    data: ComposerDataConfig
    rewards: list[RewardConfig] = Field(
        [],
        description="the rewards summed into each rollout's reward; may be left empty where episodes.environment "
        "owns the reward (a class's get_reward(), TRL's environment-owned reward, or a built-in's own)",
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
        "tokenizer's chat template, as an instruct model expects; false: the prompt text as it is "
        "(a conversational prompt is always rendered with the template)",
    )
    system_prompt: str | None = Field(
        None,
        description="a system turn put before every string prompt rendered with the chat template (the "
        "answer format, say); conversational prompts keep their own",
    )
    episodes: EpisodesConfig | None = Field(
        None,
        description="multi-turn episodes with tools and an environment instead of one completion per prompt",
    )
    record_rollouts: bool = Field(
        False,
        description="write each round's rollouts (prompt, sampled completion, reward) to the store, where "
        "`composer-serverless harvest` reads them (harvest.run); always on with a live harvest",
    )

    @model_validator(mode="after")
    def _something_to_train_on(self) -> ComposerConfig:
        # An environment's get_reward() is a reward too (whether a user's class defines one is checked where
        # the class is imported: the launcher's reward check); a built-in environment always owns one.
        episodes = self.episodes
        if episodes is not None and episodes.environment is not None and episodes.environment_reward_weight:
            return self
        if not self.rewards:
            raise ValueError(
                "no rewards: name at least one in [[composer.rewards]], or an environment that owns the "
                "reward (episodes.environment with a get_reward method, or a built-in such as 'builtin:code')"
            )
        if all(r.weight == 0 for r in self.rewards):
            raise ValueError(
                "every reward has weight 0: they are evaluation metrics, and nothing is left to train on; "
                "give at least one of them a non-zero weight"
            )
        return self

    @model_validator(mode="after")
    def _episodes_draw_once(self) -> ComposerConfig:
        if self.episodes is not None and self.rollout.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling is not available with episodes yet: set it to false")
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_the_template(self) -> ComposerConfig:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt is a turn of the chat template: set chat_template = true too")
        return self

    @field_validator("alpha")
    @classmethod
    def _alpha_non_negative(cls, alpha: float | str) -> float | str:
        if alpha != "auto" and alpha < 0:
            raise ValueError(f"alpha must be >= 0 or 'auto', got {alpha}")
        return alpha

    @property
    def sdpo_on(self) -> bool:
        """Whether the SDPO channel runs: alpha > 0 (the launcher has resolved 'auto' before any replica)."""
        return self.alpha != "auto" and self.alpha > 0

    @property
    def replay_on(self) -> bool:
        return self.beta is not None and self.beta > 0

"""Rollouts as episodes: G episodes per prompt against fresh environments, scored, and turned into the GRPO
batch (only the model's tokens scored) and the SDPO teacher batch (the hint at each episode's first error
site, or the reward's feedback at the start of the trajectory when no site was marked).

The prompt is rendered with the chat template and the tools' schemas (``tools=``), as TRL renders it, after the
environment's ``reset`` observation is appended to its last turn. The engine continues every live episode's
tokens each turn (``environments.episodes``). An episode whose environment failed scores 0 whatever its rewards
say, and is counted in ``rollout/episodes_failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from composer_serverless.config import ComposerConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.environments.builtin import environment_factory
from composer_serverless.environments.episodes import Episode, Limits, chat_codec, run_all, run_episodes
from composer_serverless.environments.protocol import Factory
from composer_serverless.environments.tensors import site_hint_batch, trajectory_tensors
from composer_serverless.losses.batches import HintBatch, RLBatch
from composer_serverless.objectives.engines import Request, RolloutEngine
from composer_serverless.objectives.rewards import RewardSet, Scored

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeSettings:
    """How a step's episodes are run (see ``config.EpisodesConfig``)."""

    factory: Factory
    limits: Limits
    hint: str
    environment_reward_weight: float
    system_prompt: str | None = None


def episode_settings(composer: ComposerConfig, code_root: Path | None) -> EpisodeSettings | None:
    """The settings ``composer.episodes`` describes, its tools and environment imported; None without it."""
    episodes = composer.episodes
    if episodes is None:
        return None
    return EpisodeSettings(
        factory=environment_factory(episodes, code_root),
        limits=Limits(
            max_turns=episodes.max_turns,
            max_tokens=episodes.max_tokens,
            turn_tokens=composer.rollout.max_new_tokens,
            tool_timeout_s=episodes.tool_timeout_s,
        ),
        hint=episodes.hint,
        environment_reward_weight=episodes.environment_reward_weight,
        system_prompt=composer.system_prompt,
    )


def reset_row(record: PromptRecord) -> dict[str, Any]:
    """What ``reset(**row)`` gets: the dataset row, its prompt and every other column (TRL passes the row)."""
    return {"prompt": record.prompt, **record.columns}


def prompt_messages(
    record: PromptRecord, observation: str | None, system: str | None
) -> list[dict[str, Any]]:
    """The prompt as messages, the observation appended to its last turn (TRL's ``reset`` contract)."""
    if isinstance(record.prompt, str):
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": record.prompt})
    else:
        messages = [dict(m) for m in record.prompt]
    if observation is not None:
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
    return messages


def run_step_episodes(
    model: nn.Module,
    tokenizer: Any,
    records: Sequence[PromptRecord],
    settings: EpisodeSettings,
    engine: RolloutEngine,
    temperature: float | None,
    eos_ids: Sequence[int],
) -> list[Episode]:
    """One episode per record (repeat a record G times for its group), in order."""
    environments = [settings.factory() for _ in records]
    resets = run_all(
        [lambda e=e, r=r: e.reset(reset_row(r)) for e, r in zip(environments, records, strict=True)],
        settings.limits.tool_timeout_s,
    )
    prompts, prompt_ids = [], []
    for record, environment, (status, observation) in zip(records, environments, resets, strict=True):
        messages = prompt_messages(record, observation if status == "ok" else None, settings.system_prompt)
        text = tokenizer.apply_chat_template(
            messages, tools=environment.tools or None, tokenize=False, add_generation_prompt=True
        )
        prompts.append(messages)
        prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    live = [i for i, (status, _) in enumerate(resets) if status == "ok"]
    pad = tokenizer.pad_token_id

    def complete(prefixes: list[list[int]], budget: int) -> list[list[int]]:
        return engine.complete(model, Request(prefixes, 1, budget, temperature, eos_ids, pad))

    ran = run_episodes(
        complete,
        [prompt_ids[i] for i in live],
        [environments[i] for i in live],
        chat_codec(tokenizer, eos_ids),
        settings.limits,
        [prompts[i] for i in live],
    )
    episodes = [Episode(ids) for ids in prompt_ids]
    for i, episode in zip(live, ran, strict=True):
        episodes[i] = episode
    for i, (status, error) in enumerate(resets):
        if status != "ok":
            why = "timed out" if status == "timeout" else f"raised {error!r}"
            episodes[i].failed = f"reset {why}"
            logger.warning("episode %d ended by its environment: reset %s", i, why)
    return episodes


def score_episodes(
    episodes: Sequence[Episode],
    records: Sequence[PromptRecord],
    rewards: RewardSet,
    settings: EpisodeSettings,
) -> Scored:
    """The rewards of the episodes' conversations, the environment's own reward added with its weight; a
    failed episode scores 0."""
    scored = rewards.score([e.messages for e in episodes], records, [e.ids for e in episodes])
    totals, by_reward = list(scored.totals), dict(scored.by_reward)
    if settings.factory.owns_reward:
        values = [e.env_reward for e in episodes]
        by_reward[settings.factory.reward_name] = values
        totals = [
            t + settings.environment_reward_weight * (v or 0.0) for t, v in zip(totals, values, strict=True)
        ]
    totals = [0.0 if e.failed is not None else t for e, t in zip(episodes, totals, strict=True)]
    return Scored(totals, by_reward, scored.feedback)


def episode_rl_batch(
    episodes: Sequence[Episode], advantages: torch.Tensor, pad_id: int, device: torch.device
) -> RLBatch:
    return RLBatch(**trajectory_tensors(episodes, pad_id, device), advantages=advantages.to(device))


def episode_hints(
    episodes: Sequence[Episode],
    feedback: Sequence[str | None],
    rl: RLBatch,
    tokenizer: Any,
    template: str,
    *,
    always: bool,
) -> HintBatch | None:
    """The SDPO teacher batch: each episode hinted at its first error site, else at the start of its
    trajectory with the reward's feedback, else not distilled."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    hints: list[tuple[int, list[int]] | None] = []
    for episode, note in zip(episodes, feedback, strict=True):
        if episode.sites:
            site = episode.sites[0]
            hints.append((site.position, encode(template.format(hint=site.hint))))
        elif note:
            hints.append((0, encode(template.format(hint=note))))
        else:
            hints.append(None)
    return site_hint_batch(episodes, hints, rl, tokenizer.pad_token_id, always=always)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-episode means under ``rollout/``: turns, tool calls, tool errors, truncations, failures."""
    n = float(len(episodes))
    return {
        "rollout/turns": sum(e.turns for e in episodes) / n,
        "rollout/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "rollout/tool_errors": sum(e.tool_errors for e in episodes) / n,
        "rollout/episodes_truncated": sum(e.truncated for e in episodes) / n,
        "rollout/episodes_failed": sum(e.failed is not None for e in episodes) / n,
    }

"""Rollouts: sample G completions per prompt from the replica's current model, score them, and build the GRPO
batch and the SDPO teacher batch from the result.

Sampling is pure: the configured engine (`engines`) samples at the configured temperature with top-k, top-p
and repetition penalties switched off whatever the model's `generation_config` says, because the GRPO and SDPO
log-probabilities are those of `softmax(logits / temperature)` and a truncated sampler would make every ratio
a lie. Prompts are left-padded and completions right-padded, the layout of `losses.compose`; a completion's
mask covers its tokens up to and including the first EOS. The model samples in eval mode without gradient and
goes back to the mode it was in.

Every inner step samples afresh and takes one gradient step on the result, so the batch is exactly on-policy
and `old_logps` is left to the loss (ratio 1), which saves a forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from composer_serverless.accelerator.clock import PhaseClock
from composer_serverless.data.chat import Rendered
from composer_serverless.data.records import Prompt, PromptRecord
from composer_serverless.environments.episodes import Episode
from composer_serverless.losses.batches import HintBatch, RLBatch
from composer_serverless.losses.grpo import ScaleRewards, dynamic_sampling_keep, group_advantages
from composer_serverless.objectives.engines import (
    GenerateEngine,
    Request,
    RolloutEngine,
    completion_tensors,
    left_pad,
)
from composer_serverless.objectives.episode_rollout import (
    EpisodeSettings,
    episode_hints,
    episode_metrics,
    episode_rl_batch,
    run_step_episodes,
    score_episodes,
)
from composer_serverless.objectives.hints import HintBuilder
from composer_serverless.objectives.rewards import RewardSet, Scored, mean


def prompt_token_ids(tokenizer: Any, prompts: Sequence[str | Rendered]) -> list[list[int]]:
    """Each prompt's token ids. A plain string gets the tokenizer's special tokens (a BOS, say) as usual; a
    prompt a chat template rendered already holds them and gets none added (no second BOS)."""
    rendered = [p if isinstance(p, Rendered) else Rendered(p, templated=False) for p in prompts]
    encoded = [tokenizer(r.text, add_special_tokens=not r.templated)["input_ids"] for r in rendered]
    empty = [r.text for r, ids in zip(rendered, encoded, strict=True) if not ids]
    if empty:
        raise ValueError(f"prompt {empty[0]!r} encodes to no tokens")
    return encoded


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str | Rendered], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) left-padded token ids and mask of ``prompts`` (``prompt_token_ids``)."""
    return left_pad(prompt_token_ids(tokenizer, prompts), tokenizer.pad_token_id, device)


def eos_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """Every token id that ends a completion: the model's generation config's, else the tokenizer's EOS."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    ids = [i for i in ids if i is not None] or [tokenizer.eos_token_id]
    if ids == [None]:
        raise ValueError("neither the model's generation config nor the tokenizer defines an EOS token")
    return ids


@contextlib.contextmanager
def whole_weights(model: nn.Module) -> Iterator[None]:
    """A model sharded with FSDP2 holds its whole weights for the block: gathered once from every rank, kept
    through every forward pass, freed at the end. Generating from the shards would gather each layer from every
    rank for every token, with the ranks in lockstep until the longest completion of any of them ends; gathered,
    each rank generates its own share alone, with any engine. Costs one whole copy of the weights in the
    compute dtype on each rank while it lasts. Any other model: nothing to do."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        yield
        return
    layers = sharded[1:]  # modules() lists the root first; it keeps its own setting (never resharded)
    for module in layers:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        for module in sharded:  # the same order on every rank: these are collectives
            module.unshard()
        yield
    finally:
        for module in sharded:
            module.reshard()
        for module in layers:
            module.set_reshard_after_forward(True, recurse=False)


REFERENCE: RolloutEngine = GenerateEngine(static=False)
"""Plain ``generate``: what greedy evaluation and every engine's tests are held to."""


@dataclass(frozen=True)
class Samples:
    """Completions of a batch of prompts, in the loss layout, with their decoded texts.

    Attributes:
        prompt_ids, prompt_mask: (B, P) left-padded prompts.
        completion_ids, completion_mask: (B, C) right-padded completions; the mask includes the EOS.
        texts: each completion decoded without its EOS and special tokens, what rewards score.
        truncated: (B,) bool, True where the completion hit the length limit without an EOS.
        token_ids: each completion's token ids up to and including its EOS (what rewards get as
            ``completion_ids``).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    truncated: torch.Tensor
    token_ids: list[list[int]]

    def select(self, rows: Sequence[int]) -> Samples:
        index = torch.tensor(list(rows), dtype=torch.long, device=self.prompt_ids.device)
        return Samples(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.completion_ids[index],
            self.completion_mask[index],
            [self.texts[i] for i in rows],
            self.truncated[index],
            [self.token_ids[i] for i in rows],
        )

    @staticmethod
    def concat(parts: Sequence[Samples], pad_id: int) -> Samples:
        """Stack batches of different widths: prompts padded on the left, completions on the right."""
        width_p = max(p.prompt_ids.size(1) for p in parts)
        width_c = max(p.completion_ids.size(1) for p in parts)

        def left(x: torch.Tensor, value: int) -> torch.Tensor:
            return F.pad(x, (width_p - x.size(1), 0), value=value)

        def right(x: torch.Tensor, value: int) -> torch.Tensor:
            return F.pad(x, (0, width_c - x.size(1)), value=value)

        return Samples(
            torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
            torch.cat([left(p.prompt_mask, 0) for p in parts]),
            torch.cat([right(p.completion_ids, pad_id) for p in parts]),
            torch.cat([right(p.completion_mask, 0) for p in parts]),
            [t for p in parts for t in p.texts],
            torch.cat([p.truncated for p in parts]),
            [t for p in parts for t in p.token_ids],
        )


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str | Rendered],
    *,
    max_new_tokens: int,
    temperature: float | None,
    repeats: int = 1,
    engine: RolloutEngine = REFERENCE,
) -> Samples:
    """Complete each prompt ``repeats`` times (rows of one prompt consecutive) with ``engine``, without
    gradient.

    Args:
        temperature: sample from ``softmax(logits / temperature)``; None decodes greedily.
    """
    device = next(model.parameters()).device
    encoded = prompt_token_ids(tokenizer, prompts)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    rows = engine.complete(model, Request(encoded, repeats, max_new_tokens, temperature, eos, pad))
    prompt_ids, prompt_mask = left_pad([ids for ids in encoded for _ in range(repeats)], pad, device)
    completion_ids, mask = completion_tensors(rows, pad, device)
    ended = [bool(row) and row[-1] in eos for row in rows]
    texts = tokenizer.batch_decode(
        [row[:-1] if end else row for row, end in zip(rows, ended, strict=True)], skip_special_tokens=True
    )
    truncated = torch.tensor([not end for end in ended], device=device)
    return Samples(prompt_ids, prompt_mask, completion_ids, mask, texts, truncated, [list(r) for r in rows])


@dataclass(frozen=True)
class RolloutSettings:
    """How one inner step's rollouts are drawn and turned into advantages (see `config.RolloutConfig`)."""

    group_size: int
    prompts_per_step: int
    max_new_tokens: int
    temperature: float
    scale_rewards: ScaleRewards = "group"
    dynamic_sampling: bool = False
    max_draws: int = 1
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # How a record's prompt becomes the model's input (rendered with the chat template, or as it is).
    render: Callable[[Prompt], Rendered] = lambda prompt: Rendered(str(prompt), templated=False)
    engine: RolloutEngine = REFERENCE
    # Multi-turn episodes against tools and an environment instead of one completion per prompt.
    episodes: EpisodeSettings | None = None


def overlong_punishment(
    lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
) -> list[float]:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13; verl's `DAPORewardManager`), per completion.

    0 up to ``max_new_tokens - buffer`` tokens (EOS included), then falling linearly to ``-penalty`` at
    ``max_new_tokens``. Added to the verifiable reward during training only: it teaches the policy to stop,
    and evaluation reports the verifiable reward alone.
    """
    exceed = lengths.float() - (max_new_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0).tolist()


@dataclass(frozen=True)
class Rollout:
    """One inner step's rollouts: everything the GRPO and SDPO channels need, and what to log.

    Attributes:
        records: the record of each row (G consecutive rows per prompt).
        samples: the completions.
        scored: their rewards and feedback.
        rl: the GRPO batch.
        hint: the SDPO teacher batch, None when no row has a hint or hints are off.
        metrics: scalars under `rollout/` (floats, or 0-dim tensors where they are on the device).
        episodes: the rows' episodes when the rollouts are episodes (their traces and conversations), else None.
    """

    records: list[PromptRecord]
    samples: Samples
    scored: Scored
    rl: RLBatch
    hint: HintBatch | None
    metrics: dict[str, float | torch.Tensor]
    episodes: list[Episode] | None = None


@dataclass(frozen=True)
class _Drawn:
    """Rows of sampled and scored completions, G consecutive rows per prompt."""

    records: list[PromptRecord]
    samples: Samples
    scored: Scored
    # Seconds the device spent generating them (0 for rows selected or stacked from draws).
    generate_s: float = 0.0

    def select(self, rows: Sequence[int]) -> _Drawn:
        return _Drawn([self.records[i] for i in rows], self.samples.select(rows), _select(self.scored, rows))

    @staticmethod
    def concat(parts: Sequence[_Drawn], pad_id: int) -> _Drawn:
        return _Drawn(
            [r for p in parts for r in p.records],
            Samples.concat([p.samples for p in parts], pad_id),
            _concat_scored([p.scored for p in parts]),
        )


def _select(scored: Scored, rows: Sequence[int]) -> Scored:
    return Scored(
        [scored.totals[i] for i in rows],
        {name: [values[i] for i in rows] for name, values in scored.by_reward.items()},
        [scored.feedback[i] for i in rows],
    )


def _concat_scored(parts: Sequence[Scored]) -> Scored:
    return Scored(
        [t for p in parts for t in p.totals],
        {name: [v for p in parts for v in p.by_reward[name]] for name in parts[0].by_reward},
        [f for p in parts for f in p.feedback],
    )


def _draw(
    model: nn.Module,
    tokenizer: Any,
    draw: Callable[[int], list[PromptRecord]],
    rewards: RewardSet,
    settings: RolloutSettings,
) -> _Drawn:
    records = draw(settings.prompts_per_step)
    clock = PhaseClock(next(model.parameters()).device)
    clock.start()
    samples = generate(
        model,
        tokenizer,
        [settings.render(r.prompt) for r in records],
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        repeats=settings.group_size,
        engine=settings.engine,
    )
    clock.lap("generate")  # generate read its tokens back, so the device is done with them
    rows = [r for r in records for _ in range(settings.group_size)]
    scored = rewards.score(samples.texts, rows, samples.token_ids, samples.truncated.tolist())
    if settings.overlong_buffer:
        punishment = overlong_punishment(
            samples.completion_mask.sum(dim=1),
            settings.max_new_tokens,
            settings.overlong_buffer,
            settings.overlong_penalty,
        )
        scored = Scored(
            [t + p for t, p in zip(scored.totals, punishment, strict=True)],
            {**scored.by_reward, "overlong": punishment},
            scored.feedback,
        )
    return _Drawn(rows, samples, scored, clock.read()["generate"])


def _dynamic_sample(
    first: _Drawn, more: Callable[[], _Drawn], settings: RolloutSettings, pad_id: int
) -> tuple[_Drawn, list[_Drawn]]:
    """DAPO dynamic sampling: (the batch of informative groups, every draw made)."""
    g = settings.group_size
    draws, kept, found = [first], [], 0
    while True:
        keep = dynamic_sampling_keep(torch.tensor(draws[-1].scored.totals), g).tolist()
        rows = [k * g + j for k, informative in enumerate(keep) if informative for j in range(g)]
        if rows:
            kept.append(draws[-1].select(rows))
            found += len(rows) // g
        if found >= settings.prompts_per_step or len(draws) == settings.max_draws:
            break
        draws.append(more())
    if not kept:
        return draws[-1], draws
    batch = _Drawn.concat(kept, pad_id)
    return batch.select(range(min(found, settings.prompts_per_step) * g)), draws


def rollout(
    model: nn.Module,
    tokenizer: Any,
    draw: Callable[[int], list[PromptRecord]],
    rewards: RewardSet,
    hints: HintBuilder | None,
    settings: RolloutSettings,
    *,
    always_hint: bool = False,
) -> Rollout:
    """Draw prompts, sample G completions each, score them and build the GRPO and SDPO batches.

    With dynamic sampling (DAPO), groups whose rewards are all equal carry no GRPO gradient and are dropped;
    further prompt batches are drawn until ``prompts_per_step`` informative groups are found or ``max_draws``
    batches were drawn. If no group is informative after that, the last batch is kept as it is: its GRPO
    gradient is zero, but the SDPO channel still learns from its hints.

    Args:
        draw: returns the next ``n`` prompt records of this replica's shard.
        hints: builds the SDPO teacher prompts; None when the SDPO channel is off.
        always_hint: build the teacher batch even when no row has a hint (its distill mask all zero): a
            sharded replica's ranks decide together whether the teacher passes run (``micro.across_ranks``).
    """
    g = settings.group_size
    if settings.episodes is not None:
        return _episode_rollout(model, tokenizer, draw, rewards, hints, settings, always_hint=always_hint)
    first = _draw(model, tokenizer, draw, rewards, settings)
    batch, draws = first, [first]
    if settings.dynamic_sampling:
        batch, draws = _dynamic_sample(
            first, lambda: _draw(model, tokenizer, draw, rewards, settings), settings, tokenizer.pad_token_id
        )
    samples = batch.samples
    # Rewards are host values: their advantages are computed (and checked) on the host, then moved.
    totals = torch.tensor(batch.scored.totals, dtype=torch.float32)
    rl = RLBatch(
        prompt_ids=samples.prompt_ids,
        prompt_mask=samples.prompt_mask,
        completion_ids=samples.completion_ids,
        completion_mask=samples.completion_mask,
        advantages=group_advantages(totals, g, settings.scale_rewards).to(samples.prompt_ids.device),
    )
    hint = None
    if hints is not None:
        teacher = hints.group_hints(
            batch.records, samples.texts, batch.scored.totals, batch.scored.feedback, g
        )
        student = [settings.render(r.prompt) for r in batch.records]
        hint = _hint_batch(tokenizer, student, teacher, rl, always=always_hint)
    metrics = _metrics(_concat_scored([d.scored for d in draws]), samples, hint, g)
    # Throughput of everything generated this step: the tokens up to each EOS, and the device's time.
    metrics["rollout/tokens"] = sum(d.samples.completion_mask.sum() for d in draws).float()
    metrics["rollout/generate_s"] = sum(d.generate_s for d in draws)
    if settings.dynamic_sampling:
        metrics["rollout/draws"] = float(len(draws))
        metrics["rollout/groups"] = float(len(batch.records) // g)
    return Rollout(batch.records, samples, batch.scored, rl, hint, metrics)


def _episode_rollout(
    model: nn.Module,
    tokenizer: Any,
    draw: Callable[[int], list[PromptRecord]],
    rewards: RewardSet,
    hints: HintBuilder | None,
    settings: RolloutSettings,
    *,
    always_hint: bool,
) -> Rollout:
    """``rollout`` with G episodes per prompt (``episode_rollout``); the samples are the whole trajectories."""
    assert settings.episodes is not None
    g = settings.group_size
    rows = [r for r in draw(settings.prompts_per_step) for _ in range(g)]
    device = next(model.parameters()).device
    clock = PhaseClock(device)
    clock.start()
    eos = eos_token_ids(model, tokenizer)
    episodes = run_step_episodes(
        model, tokenizer, rows, settings.episodes, settings.engine, settings.temperature, eos
    )
    clock.lap("generate")
    scored = score_episodes(episodes, rows, rewards, settings.episodes)
    advantages = group_advantages(torch.tensor(scored.totals, dtype=torch.float32), g, settings.scale_rewards)
    rl = episode_rl_batch(episodes, advantages, tokenizer.pad_token_id, device)
    hint = None
    if hints is not None:
        hint = episode_hints(
            episodes, scored.feedback, rl, tokenizer, settings.episodes.hint, always=always_hint
        )
    samples = Samples(
        rl.prompt_ids,
        rl.prompt_mask,
        rl.completion_ids,
        rl.completion_mask,
        [tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes],
        torch.tensor([e.truncated for e in episodes], device=device),
        [list(e.ids) for e in episodes],
    )
    metrics = {**_metrics(scored, samples, hint, g), **episode_metrics(episodes)}
    metrics["rollout/tokens"] = rl.scored_mask().sum().float()  # the model's tokens only
    metrics["rollout/generate_s"] = clock.read()["generate"]
    return Rollout(rows, samples, scored, rl, hint, metrics, episodes)


def _hint_batch(
    tokenizer: Any,
    student: Sequence[Rendered],
    teacher: Sequence[Rendered | None],
    rl: RLBatch,
    *,
    always: bool,
) -> HintBatch | None:
    """The teacher's sequences `[hinted prompt, completion]`; rows without a hint keep the student's prompt
    and are not distilled. None when no row has a hint, unless ``always``."""
    flags = [p is not None for p in teacher]
    if not any(flags) and not always:
        return None
    hinted = torch.tensor(flags, device=rl.completion_ids.device)
    prompts = [t if t is not None else s for t, s in zip(teacher, student, strict=True)]
    ids, mask = encode_prompts(tokenizer, prompts, rl.completion_ids.device)
    return HintBatch.from_hinted_prompts(
        ids, mask, rl, distill_mask=rl.completion_mask * hinted[:, None].long()
    )


def _metrics(
    sampled: Scored, batch: Samples, hint: HintBatch | None, g: int
) -> dict[str, float | torch.Tensor]:
    """Rewards over everything sampled this step (the policy's performance); lengths and hints of the
    batch, as 0-dim tensors where they are on the device (the trainer reads a step's metrics in one go)."""
    totals = torch.tensor(sampled.totals, dtype=torch.float32)
    metrics: dict[str, float | torch.Tensor] = {
        "rollout/reward_mean": float(totals.mean()),
        "rollout/reward_std": float(totals.std(correction=0)),
        "rollout/frac_zero_std": float((~dynamic_sampling_keep(totals, g)).float().mean()),
        "rollout/completion_len": batch.completion_mask.sum(dim=1).float().mean(),
        "rollout/truncated": batch.truncated.float().mean(),
        "rollout/hinted": 0.0 if hint is None else hint.distill_mask.any(dim=1).float().mean(),
    }
    for name, values in sampled.by_reward.items():  # over the rows the reward applies to
        total, count = mean(values)
        if count:
            metrics[f"rollout/reward/{name}"] = total / count
            present = torch.tensor([v for v in values if v is not None], dtype=torch.float64)
            metrics[f"rollout/reward_std/{name}"] = float(present.std(correction=0))
    return metrics

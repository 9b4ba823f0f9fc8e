"""The three-channel loss `L_grpo + alpha * L_sdpo + beta * L_replay` and the forward passes it needs.

`three_channel_loss(model, batch, settings)` runs exactly the passes the active channels need and nothing else:

- the student pass over `[prompt, completion]`, shared by GRPO and SDPO, whenever the batch has an RL part;
- the teacher pass over the hinted sequence, under `torch.no_grad()`, only when `alpha != 0` and a hint part is
  given; it uses the same weights, so dropout must be off (checked), or teacher and student would be different
  networks and the divergence would measure dropout noise;
- the replay pass over chosen and rejected completions, only when `beta != 0` and a replay part is given.

A channel that is switched off (weight 0) or has no inputs costs no forward pass and adds nothing, so with
`alpha = beta = 0` the loss and its gradients are bit-identical to GRPO alone. Each channel is normalised by its
own count (GRPO as its `loss_type` says, SDPO by distilled tokens, replay by pairs), and its metrics are
namespaced (`grpo/`, `sdpo/`, `replay/`, plus `loss/total`); an inactive channel reports no metrics. None of the
passes materialises batch x sequence x vocabulary logits (see `logprobs`).

Padding convention for every part: prompts (contexts) LEFT-padded, completions RIGHT-padded, as `generate` and
vLLM return them with left-padded prompts. Completion token j of every row is then column P + j of
`[prompt, completion]`.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from composer_serverless.losses.grpo import GRPOSettings, grpo_loss
from composer_serverless.losses.logprobs import (
    LMHead,
    completion_hidden_states,
    hidden_states,
    lm_head_of,
    token_logprobs_and_divergence,
)
from composer_serverless.losses.replay import ReplaySettings, replay_loss
from composer_serverless.losses.sdpo import SDPOSettings, sdpo_loss, token_divergence

Metrics = dict[str, torch.Tensor]


def _require(condition: bool | torch.Tensor, message: str) -> None:
    if not bool(condition):
        raise ValueError(message)


def _check_ids(name: str, ids: torch.Tensor) -> None:
    _require(ids.dim() == 2, f"{name} must be 2-D (rows, tokens), got shape {tuple(ids.shape)}")
    _require(
        not ids.dtype.is_floating_point and ids.dtype != torch.bool, f"{name} must hold integer token ids"
    )


def _check_mask(name: str, mask: torch.Tensor, like: torch.Tensor) -> None:
    _require(mask.shape == like.shape, f"{name} shape {tuple(mask.shape)} != ids shape {tuple(like.shape)}")
    _require(((mask == 0) | (mask == 1)).all(), f"{name} must hold only 0 and 1")


def _check_left_padded(name: str, mask: torch.Tensor) -> None:
    _require(not (mask[:, 1:] < mask[:, :-1]).any(), f"{name} must be left-padded (zeros, then ones)")
    _require(mask.size(1) > 0 and mask[:, -1].all(), f"{name}: every row needs at least one prompt token")


def _check_right_padded(name: str, mask: torch.Tensor) -> None:
    _require(not (mask[:, 1:] > mask[:, :-1]).any(), f"{name} must be right-padded (ones, then zeros)")


def _check_prompt_completion(
    prefix: str,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    what: str,
) -> None:
    _check_ids(f"{prefix}.prompt_ids", prompt_ids)
    _check_mask(f"{prefix}.prompt_mask", prompt_mask, prompt_ids)
    _check_left_padded(f"{prefix}.prompt_mask", prompt_mask)
    _check_ids(f"{prefix}.{what}_ids", ids)
    _check_mask(f"{prefix}.{what}_mask", mask, ids)
    _check_right_padded(f"{prefix}.{what}_mask", mask)
    _require(
        ids.size(0) == prompt_ids.size(0),
        f"{prefix}: {ids.size(0)} {what} rows for {prompt_ids.size(0)} prompts",
    )


@dataclass(frozen=True)
class RLBatch:
    """Completions sampled from the current policy, G per prompt, with their advantages: the GRPO input.

    Row b is `[prompt_ids[b], completion_ids[b]]`; prompts left-padded, completions right-padded.

    Attributes:
        prompt_ids: (B, P) int, left-padded prompts; the G completions of a prompt are G rows.
        prompt_mask: (B, P) 0/1, 1 on prompt tokens; every row has at least one.
        completion_ids: (B, C) int, right-padded sampled completions (with EOS when it was sampled).
        completion_mask: (B, C) 0/1, 1 on completion tokens up to and including EOS, 0 on the padding after.
        advantages: (B,) float, one per completion, e.g. `grpo.group_advantages(rewards, G)`; or (B, C) per token.
        loss_mask: (B, C) 0/1 or None; the completion tokens that enter the GRPO loss, default `completion_mask`.
            Zero out tokens the policy did not sample (tool outputs) or whole truncated completions.
        old_logps: (B, C) float or None; log pi_old of each sampled token at sampling time and temperature
            (`logprobs.completion_logprobs` under no_grad). None means on-policy: the ratio is exactly 1.
        ref_logps: (B, C) float or None; reference-model log-probs, needed when `GRPOSettings.kl_beta > 0`.
        num_items: loss-token count of everything one optimizer step averages over (all micro-batches and ranks),
            the `dapo` normaliser; None means this batch's count.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_items: int | torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_prompt_completion(
            "RLBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            "completion",
        )
        rows, width = self.completion_ids.shape
        _require(
            self.advantages.shape in ((rows,), (rows, width)) and self.advantages.dtype.is_floating_point,
            f"RLBatch.advantages must be float (B,) or (B, C), got {tuple(self.advantages.shape)}",
        )
        if self.loss_mask is not None:
            _check_mask("RLBatch.loss_mask", self.loss_mask, self.completion_ids)
            _require(
                not (self.loss_mask.bool() & ~self.completion_mask.bool()).any(),
                "RLBatch.loss_mask must be a subset of completion_mask",
            )
        for name in ("old_logps", "ref_logps"):
            value = getattr(self, name)
            _require(
                value is None or (value.shape == (rows, width) and value.dtype.is_floating_point),
                f"RLBatch.{name} must be float (B, C) = {(rows, width)}",
            )

    def scored_mask(self) -> torch.Tensor:
        """(B, C) bool, the tokens of the GRPO loss."""
        return (self.completion_mask if self.loss_mask is None else self.loss_mask).bool()


@dataclass(frozen=True)
class HintBatch:
    """The hinted teacher's view of the RL batch's completions: the SDPO input. Row b belongs to RL row b.

    The teacher sequence is the student's sequence with a hint inserted anywhere before the tokens it teaches (in
    the prompt, or inside the completion near a mistake); `teacher_positions` says where each completion token
    landed. Padding of `teacher_ids` is free (positions come from the mask); `from_hinted_prompts` builds the
    common case `[hinted prompt, completion]`.

    Attributes:
        teacher_ids: (B, T) int, the hinted sequences.
        teacher_mask: (B, T) 0/1, 1 on real tokens.
        teacher_positions: (B, C) int, column of completion token j of row b in `teacher_ids`, so that
            `teacher_ids[b, teacher_positions[b, j]] == completion_ids[b, j]` (checked); read only where
            `distill_mask` is 1, must be >= 1 there (the token needs a predecessor).
        distill_mask: (B, C) 0/1, the completion tokens that receive the SDPO loss, a subset of the RL
            `completion_mask`; all zero for rows without a hint (SDPO: samples with neither a solution nor feedback).
        num_items: distilled-token count of everything one optimizer step averages over; None: this batch's.
    """

    teacher_ids: torch.Tensor
    teacher_mask: torch.Tensor
    teacher_positions: torch.Tensor
    distill_mask: torch.Tensor
    num_items: int | torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_ids("HintBatch.teacher_ids", self.teacher_ids)
        _check_mask("HintBatch.teacher_mask", self.teacher_mask, self.teacher_ids)
        _check_ids("HintBatch.teacher_positions", self.teacher_positions)
        _check_mask("HintBatch.distill_mask", self.distill_mask, self.teacher_positions)
        _require(
            self.teacher_positions.size(0) == self.teacher_ids.size(0),
            f"HintBatch: {self.teacher_positions.size(0)} position rows for {self.teacher_ids.size(0)} sequences",
        )

    @classmethod
    def from_hinted_prompts(
        cls,
        hinted_prompt_ids: torch.Tensor,
        hinted_prompt_mask: torch.Tensor,
        rl: RLBatch,
        distill_mask: torch.Tensor | None = None,
        num_items: int | torch.Tensor | None = None,
    ) -> HintBatch:
        """Teacher sequences `[hinted prompt, the RL completion]`.

        Args:
            hinted_prompt_ids: (B, Ph) int, left-padded prompts with the hint inserted.
            hinted_prompt_mask: (B, Ph) 0/1.
            rl: the RL batch whose completions the teacher scores.
            distill_mask: (B, C) 0/1 or None for `rl.completion_mask` (distil every completion token).
            num_items: see the class attributes.
        """
        _check_ids("hinted_prompt_ids", hinted_prompt_ids)
        _check_mask("hinted_prompt_mask", hinted_prompt_mask, hinted_prompt_ids)
        _check_left_padded("hinted_prompt_mask", hinted_prompt_mask)
        rows, width = rl.completion_ids.shape
        offset = hinted_prompt_ids.size(1)
        positions = torch.arange(offset, offset + width, device=rl.completion_ids.device).expand(rows, width)
        return cls(
            teacher_ids=torch.cat([hinted_prompt_ids, rl.completion_ids], dim=1),
            teacher_mask=torch.cat([hinted_prompt_mask.long(), rl.completion_mask.long()], dim=1),
            teacher_positions=positions,
            distill_mask=rl.completion_mask if distill_mask is None else distill_mask,
            num_items=num_items,
        )


@dataclass(frozen=True)
class ReplayBatch:
    """Preference pairs from frozen traces, both completions of the same context: the replay input.

    Prompts left-padded, completions right-padded, as in `RLBatch`.

    Attributes:
        prompt_ids: (N, P) int, left-padded shared contexts, one per pair.
        prompt_mask: (N, P) 0/1.
        chosen_ids: (N, Lw) int, right-padded preferred completions (e.g. the teacher's action).
        chosen_mask: (N, Lw) 0/1, 1 on completion tokens; only these are scored.
        rejected_ids: (N, Ll) int, right-padded dispreferred completions (e.g. the student's action).
        rejected_mask: (N, Ll) 0/1.
        ref_chosen_logps: (N,) float or None; log pi_ref(chosen | prompt) summed over the completion tokens at
            temperature 1, i.e. `completion_logprobs(ref_model, prompt_ids, prompt_mask, chosen_ids,
            chosen_mask).sum(-1)` under no_grad. Required for DPO, unused by SimPO.
        ref_rejected_logps: (N,) float or None, the same for the rejected completions.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_prompt_completion(
            "ReplayBatch", self.prompt_ids, self.prompt_mask, self.chosen_ids, self.chosen_mask, "chosen"
        )
        _check_prompt_completion(
            "ReplayBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.rejected_ids,
            self.rejected_mask,
            "rejected",
        )
        pairs = self.prompt_ids.size(0)
        _require(
            (self.ref_chosen_logps is None) == (self.ref_rejected_logps is None),
            "ReplayBatch: give both reference tensors or neither",
        )
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            value = getattr(self, name)
            _require(value is None or value.shape == (pairs,), f"ReplayBatch.{name} must be ({pairs},)")


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch of the three-channel loss; a missing part switches its channel off.

    Attributes:
        rl: GRPO rollouts; also the student side of SDPO.
        hint: SDPO teacher sequences for the rows of `rl` (needs `rl`).
        replay: preference pairs.
    """

    rl: RLBatch | None = None
    hint: HintBatch | None = None
    replay: ReplayBatch | None = None

    def __post_init__(self) -> None:
        _require(self.hint is None or self.rl is not None, "LossBatch.hint needs the rl part it distils")


@dataclass(frozen=True)
class LossSettings:
    """Weights and per-channel hyper-parameters of `L_grpo + alpha * L_sdpo + beta * L_replay`.

    Attributes:
        alpha: SDPO weight; 0 switches the channel and its teacher pass off.
        beta: replay weight; 0 switches the channel and its pass off.
        grpo: channel-1 settings (also the temperature of the student log-probs).
        sdpo: channel-2 settings.
        replay: channel-3 settings.
        chunk_tokens: tokens per LM-head chunk; the head's extra peak memory is a few (chunk_tokens, V) float32
            tensors, so lower it for large vocabularies and raise it when memory is plentiful (fewer, larger
            matmuls).
    """

    alpha: float = 0.0
    beta: float = 0.0
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    sdpo: SDPOSettings = field(default_factory=SDPOSettings)
    replay: ReplaySettings = field(default_factory=ReplaySettings)
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        _require(
            self.alpha >= 0 and self.beta >= 0, f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}"
        )
        _require(self.chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {self.chunk_tokens}")


def _require_no_dropout(model: nn.Module) -> None:
    active = [
        name for name, module in model.named_modules() if isinstance(module, nn.Dropout) and module.p > 0
    ]
    if getattr(model.config.get_text_config(), "attention_dropout", 0.0):
        active.append("config.attention_dropout")
    _require(
        not active,
        "SDPO's teacher pass reuses the student's weights; with dropout active the two passes drop different "
        f"units and the teacher is a different network. Set these to 0 (or call model.eval()): {active}",
    )


def _check_alignment(rl: RLBatch, hint: HintBatch) -> None:
    _require(
        hint.teacher_positions.shape == rl.completion_ids.shape,
        f"HintBatch.teacher_positions {tuple(hint.teacher_positions.shape)} != completion_ids "
        f"{tuple(rl.completion_ids.shape)}",
    )
    distill = hint.distill_mask.bool()
    _require(
        not (distill & ~rl.completion_mask.bool()).any(),
        "HintBatch.distill_mask must be within completion_mask",
    )
    rows, cols = distill.nonzero(as_tuple=True)
    positions = hint.teacher_positions[rows, cols]
    _require(
        ((positions >= 1) & (positions < hint.teacher_ids.size(1))).all(),
        "HintBatch.teacher_positions must lie in [1, T) where distill_mask is 1",
    )
    _require(
        (hint.teacher_ids[rows, positions] == rl.completion_ids[rows, cols]).all()
        and hint.teacher_mask[rows, positions].bool().all(),
        "HintBatch.teacher_positions do not point at the completion tokens in teacher_ids",
    )


def _teacher_hidden(model: nn.Module, hint: HintBatch) -> torch.Tensor:
    """(M, H) teacher hidden states predicting each distilled token, row-major over (B, C); no gradient."""
    if model.training:
        _require_no_dropout(model)
    with torch.no_grad():
        hidden = hidden_states(model, hint.teacher_ids, hint.teacher_mask)
    rows, cols = hint.distill_mask.bool().nonzero(as_tuple=True)
    return hidden[rows, hint.teacher_positions[rows, cols] - 1]


def _policy_channels(
    model: nn.Module, head: LMHead, rl: RLBatch, hint: HintBatch | None, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor | None, Metrics]:
    """GRPO loss, SDPO loss (None without a hint) and their metrics, from one student pass."""
    loss_mask = rl.scored_mask()
    scored = loss_mask
    teacher_hidden = teacher_rows = None
    if hint is not None:
        _check_alignment(rl, hint)
        distill = hint.distill_mask.bool()
        scored = loss_mask | distill
        teacher_hidden = _teacher_hidden(model, hint)
        teacher_rows = (scored.flatten().cumsum(0) - 1)[distill.flatten()]
    hidden = completion_hidden_states(
        model, rl.prompt_ids, rl.prompt_mask, rl.completion_ids, rl.completion_mask
    )
    logps, divergence = token_logprobs_and_divergence(
        hidden[scored],
        rl.completion_ids[scored],
        head,
        temperature=settings.grpo.temperature,
        chunk_tokens=settings.chunk_tokens,
        teacher_hidden=teacher_hidden,
        teacher_rows=teacher_rows,
        divergence=functools.partial(token_divergence, settings=settings.sdpo),
    )
    grpo, metrics = grpo_loss(
        logps.new_zeros(scored.shape).masked_scatter(scored, logps),
        rl.advantages,
        loss_mask,
        settings.grpo,
        old_logps=rl.old_logps,
        ref_logps=rl.ref_logps,
        num_items=rl.num_items,
    )
    if hint is None:
        return grpo, None, metrics
    sdpo, sdpo_metrics = sdpo_loss(
        divergence.new_zeros(distill.shape).masked_scatter(distill, divergence),
        distill,
        settings.sdpo,
        num_items=hint.num_items,
    )
    return grpo, sdpo, {**metrics, **sdpo_metrics}


def _replay_channel(
    model: nn.Module, head: LMHead, replay: ReplayBatch, settings: LossSettings
) -> tuple[torch.Tensor, Metrics]:
    """Chosen and rejected completions scored in one pass, as 2N rows padded to a common width."""
    chosen_width, rejected_width = replay.chosen_ids.size(1), replay.rejected_ids.size(1)
    width = max(chosen_width, rejected_width)
    completions = torch.cat(
        [
            F.pad(replay.chosen_ids, (0, width - chosen_width)),
            F.pad(replay.rejected_ids, (0, width - rejected_width)),
        ]
    )
    masks = torch.cat(
        [
            F.pad(replay.chosen_mask.long(), (0, width - chosen_width)),
            F.pad(replay.rejected_mask.long(), (0, width - rejected_width)),
        ]
    )
    prompts = torch.cat([replay.prompt_ids, replay.prompt_ids])
    prompt_mask = torch.cat([replay.prompt_mask, replay.prompt_mask])
    scored = masks.bool()
    hidden = completion_hidden_states(model, prompts, prompt_mask, completions, masks)
    logps, _ = token_logprobs_and_divergence(
        hidden[scored], completions[scored], head, temperature=1.0, chunk_tokens=settings.chunk_tokens
    )
    chosen, rejected = logps.new_zeros(scored.shape).masked_scatter(scored, logps).chunk(2)
    return replay_loss(
        chosen[:, :chosen_width],
        replay.chosen_mask,
        rejected[:, :rejected_width],
        replay.rejected_mask,
        settings.replay,
        ref_chosen_logps=replay.ref_chosen_logps,
        ref_rejected_logps=replay.ref_rejected_logps,
    )


def _graph_zero(model: nn.Module) -> torch.Tensor:
    """An exact 0 that depends on every trainable parameter, so backward runs and leaves zero gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    _require(params, f"{type(model).__name__} has no trainable parameters")
    return torch.stack([p.sum() for p in params]).sum() * 0.0


def three_channel_loss(
    model: nn.Module, batch: LossBatch, settings: LossSettings
) -> tuple[torch.Tensor, Metrics]:
    """`L_grpo + alpha * L_sdpo + beta * L_replay` for one micro-batch, running only the passes it needs.

    Args:
        model: a Hugging Face causal LM, in the mode the caller trains in.
        batch: the parts present; a missing part switches its channel off.
        settings: weights and per-channel settings.

    Returns:
        The scalar loss to backpropagate (an exact, differentiable 0 when no channel is active) and detached
        scalar metrics: the active channels' `grpo/*`, `sdpo/*`, `replay/*` and `loss/total`.
    """
    use_sdpo = settings.alpha != 0 and batch.hint is not None and bool(batch.hint.distill_mask.any())
    use_replay = settings.beta != 0 and batch.replay is not None
    head = lm_head_of(model)
    terms: list[torch.Tensor] = []
    metrics: Metrics = {}
    if batch.rl is not None:
        grpo, sdpo, policy_metrics = _policy_channels(
            model, head, batch.rl, batch.hint if use_sdpo else None, settings
        )
        terms.append(grpo)
        if sdpo is not None:
            terms.append(settings.alpha * sdpo)
        metrics.update(policy_metrics)
    if use_replay:
        replay, replay_metrics = _replay_channel(model, head, batch.replay, settings)
        terms.append(settings.beta * replay)
        metrics.update(replay_metrics)
    total = functools.reduce(operator.add, terms) if terms else _graph_zero(model)
    metrics["loss/total"] = total.detach()
    return total, metrics

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

from composer_serverless.losses.batches import Checks, HintBatch, LossBatch, ReplayBatch, RLBatch, require
from composer_serverless.losses.grpo import GRPOSettings, grpo_loss
from composer_serverless.losses.logprobs import (
    completion_hidden_states,
    hidden_states,
    lm_head_of,
    token_logprobs_and_divergence,
)
from composer_serverless.losses.replay import ReplaySettings, replay_loss
from composer_serverless.losses.sdpo import SDPOSettings, sdpo_loss, token_divergence

Metrics = dict[str, torch.Tensor]


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
        require(
            self.alpha >= 0 and self.beta >= 0, f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}"
        )
        require(self.chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {self.chunk_tokens}")


def _require_no_dropout(model: nn.Module) -> None:
    active = [
        name for name, module in model.named_modules() if isinstance(module, nn.Dropout) and module.p > 0
    ]
    if getattr(model.config.get_text_config(), "attention_dropout", 0.0):
        active.append("config.attention_dropout")
    require(
        not active,
        "SDPO's teacher pass reuses the student's weights; with dropout active the two passes drop different "
        f"units and the teacher is a different network. Set these to 0 (or call model.eval()): {active}",
    )


def _check_alignment(rl: RLBatch, hint: HintBatch) -> None:
    """Every distilled completion token is where ``teacher_positions`` says in the teacher's sequence. Read
    at every position, clamped into range, so no check indexes out of bounds before the range is verified
    (together with the others, in one wait for the device)."""
    checks = Checks()
    checks.require(
        hint.teacher_positions.shape == rl.completion_ids.shape,
        f"HintBatch.teacher_positions {tuple(hint.teacher_positions.shape)} != completion_ids "
        f"{tuple(rl.completion_ids.shape)}",
    )
    distill = hint.distill_mask.bool()
    checks.require(
        ~(distill & ~rl.completion_mask.bool()).any(),
        "HintBatch.distill_mask must be within completion_mask",
    )
    width = hint.teacher_ids.size(1)
    positions = hint.teacher_positions
    checks.require(
        (~distill | ((positions >= 1) & (positions < width))).all(),
        "HintBatch.teacher_positions must lie in [1, T) where distill_mask is 1",
    )
    at = positions.clamp(0, max(width - 1, 0))
    checks.require(
        (~distill | (hint.teacher_ids.gather(1, at) == rl.completion_ids)).all()
        & (~distill | hint.teacher_mask.gather(1, at).bool()).all(),
        "HintBatch.teacher_positions do not point at the completion tokens in teacher_ids",
    )
    checks.verify()


def _teacher_hidden(model: nn.Module, hint: HintBatch) -> torch.Tensor:
    """(M, H) teacher hidden states predicting each distilled token, row-major over (B, C); no gradient."""
    if model.training:
        _require_no_dropout(model)
    with torch.no_grad():
        hidden = hidden_states(model, hint.teacher_ids, hint.teacher_mask)
    rows, cols = hint.distill_mask.bool().nonzero(as_tuple=True)
    return hidden[rows, hint.teacher_positions[rows, cols] - 1]


def _policy_channels(
    model: nn.Module, rl: RLBatch, hint: HintBatch | None, settings: LossSettings
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
        lm_head_of(model),  # after the pass: a sharded model's head is whole only from then on
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
        num_items=rl.num_items if settings.grpo.loss_type in ("bnpo", "dapo") else None,
        num_sequences=rl.num_sequences if settings.grpo.loss_type in ("grpo", "dr_grpo") else None,
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
    model: nn.Module, replay: ReplayBatch, settings: LossSettings
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
        hidden[scored],
        completions[scored],
        lm_head_of(model),
        temperature=1.0,
        chunk_tokens=settings.chunk_tokens,
    )
    chosen, rejected = logps.new_zeros(scored.shape).masked_scatter(scored, logps).chunk(2)
    loss, metrics = replay_loss(
        chosen[:, :chosen_width],
        replay.chosen_mask,
        rejected[:, :rejected_width],
        replay.rejected_mask,
        settings.replay,
        ref_chosen_logps=replay.ref_chosen_logps,
        ref_rejected_logps=replay.ref_rejected_logps,
    )
    # A mean over this micro-batch's pairs, weighed by their share of the step's.
    if replay.num_pairs is not None:
        loss = loss * (replay.prompt_ids.size(0) / replay.num_pairs)
        metrics["replay/loss"] = loss.detach()
    return loss, metrics


def _graph_zero(model: nn.Module) -> torch.Tensor:
    """An exact 0 that depends on every trainable parameter, so backward runs and leaves zero gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    require(params, f"{type(model).__name__} has no trainable parameters")
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
    use_sdpo = (
        settings.alpha != 0
        and batch.hint is not None
        and (batch.hint.always or bool(batch.hint.distill_mask.any()))
    )
    use_replay = settings.beta != 0 and batch.replay is not None
    lm_head_of(model)  # a model whose head the loss cannot apply fails here, before any pass
    terms: list[torch.Tensor] = []
    metrics: Metrics = {}
    if batch.rl is not None:
        grpo, sdpo, policy_metrics = _policy_channels(
            model, batch.rl, batch.hint if use_sdpo else None, settings
        )
        terms.append(grpo)
        if sdpo is not None:
            terms.append(settings.alpha * sdpo)
        metrics.update(policy_metrics)
    if use_replay:
        replay, replay_metrics = _replay_channel(model, batch.replay, settings)
        terms.append(settings.beta * replay)
        metrics.update(replay_metrics)
    total = functools.reduce(operator.add, terms) if terms else _graph_zero(model)
    metrics["loss/total"] = total.detach()
    return total, metrics

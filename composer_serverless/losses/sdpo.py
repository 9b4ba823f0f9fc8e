"""Channel 2: SDPO, self-distillation from the same model conditioned on a hint.

The teacher is the current model given a hint (a solution, feedback, a nudge near the mistake); the student is the
model without it; both score the student's own sampled completion. Per token the loss is the generalized
Jensen-Shannon divergence of GKD (arXiv 2306.13649, Eq. 1) between S = softmax(z_s / tau) and
T = softmax(z_t / tau), with the same tau for both:

- beta = 0: KL(T || S), "forward" KL (mean-seeking);
- beta = 1: KL(S || T), "reverse" KL (mode-seeking), the objective of the SDPO paper (arXiv 2601.20802, Eq. 1);
- 0 < beta < 1: beta * KL(T || M) + (1 - beta) * KL(S || M) with M = beta * T + (1 - beta) * S.

Throughout, KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)). This equals TRL 1.16's
`GKDTrainer.generalized_jsd_loss` and OPSD's `generalized_jsd_loss`, including the discontinuity at the endpoints
(beta -> 0+ tends to 0, not to KL(T || S)), but not their two defects:

- a batch whose every token is masked gives an exact 0 that is still part of the graph, never 0 / 0 = NaN;
- the optional `token_clip` caps each token's divergence after the vocabulary sum. OPSD clamps each vocabulary
  term before the sum; the terms of a pure KL are negative wherever S(v) > T(v), so clamping only the positive
  ones makes per-token losses negative and pushes the student away from the teacher's strongest tokens.

The stop-gradient on the teacher is not the caller's job here: `token_divergence` detaches the teacher logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SDPOSettings:
    """Hyper-parameters of the SDPO channel.

    Attributes:
        beta: interpolation of the generalized JSD, in [0, 1]; 0 is KL(T || S), 1 is KL(S || T). The default 0.5 is
            the symmetric JSD, TRL's `GKDConfig` default and the SDPO reference code's default.
        temperature: tau applied to both student and teacher logits; use the sampling temperature.
        top_k: if set, compare the distributions on the teacher's k most likely tokens plus one tail bucket that
            holds the rest of each distribution's mass (see `token_divergence`).
        token_clip: if set, each token's divergence is capped at this value after the vocabulary sum, so tokens
            beyond the cap stop contributing gradient (e.g. a format token the hinted teacher always disagrees on).
    """

    beta: float = 0.5
    temperature: float = 1.0
    top_k: int | None = None
    token_clip: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.token_clip is not None and self.token_clip <= 0:
            raise ValueError(f"token_clip must be > 0 or None, got {self.token_clip}")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits lose the small differences a KL is made of; float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)) over the last dimension, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _top_k_with_tail(log_p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(..., V) log-probabilities -> (..., k + 1): the entries at `index`, then the log-mass of all others.

    The tail is a logsumexp over the other entries, not log(1 - sum(top)): in float32 that difference keeps no
    digits once the tail drops near 1e-7, and reverse KL weighs the student's tail by log(S_tail / T_tail).
    """
    tail = log_p.scatter(-1, index, float("-inf")).logsumexp(dim=-1, keepdim=True)
    return torch.cat([log_p.gather(-1, index), tail], dim=-1)


def generalized_jsd(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD between two normalised distributions given as log-probabilities over the last dim.

    Args:
        log_s: (..., V) student log-probabilities, log S.
        log_t: (..., V) teacher log-probabilities, log T.
        beta: 0 gives KL(T || S), 1 gives KL(S || T), else beta * KL(T || M) + (1 - beta) * KL(S || M) with
            M = beta * T + (1 - beta) * S.

    Returns:
        (...) the divergence, summed over the last dim.
    """
    if beta == 0:
        return _kl(log_t, log_s)
    if beta == 1:
        return _kl(log_s, log_t)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)


def token_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, settings: SDPOSettings
) -> torch.Tensor:
    """Per-token generalized JSD between student and teacher next-token distributions.

    The teacher logits are detached here, so no gradient can reach the teacher pass whatever the caller does.

    Top-k semantics (`settings.top_k = k`): the teacher's k most likely tokens, chosen on the full distributions,
    plus one tail bucket holding the rest of each distribution's mass. The divergence is then that of two proper
    distributions over k + 1 outcomes, so it stays >= 0, never exceeds the full-vocabulary divergence
    (data-processing inequality) and equals it for k >= V - 1. Teacher top-k follows OPSD, because the hinted teacher
    is the signal and its top tokens are where the student should move mass; the tail bucket follows the SDPO
    reference code, because without it (OPSD renormalises over the k tokens) a student with most of its mass
    outside the teacher's top-k can still score zero.

    Args:
        student_logits: (..., V) raw logits of the student (before temperature).
        teacher_logits: (..., V) raw logits of the teacher, same shape.
        settings: beta, temperature, top_k.

    Returns:
        (...) divergence per token, in float32 (float64 stays float64).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ"
        )
    tau = settings.temperature
    log_s = torch.log_softmax(_upcast(student_logits) / tau, dim=-1)
    log_t = torch.log_softmax(_upcast(teacher_logits.detach()) / tau, dim=-1)
    if settings.top_k is not None and settings.top_k < log_s.size(-1):
        index = log_t.topk(settings.top_k, dim=-1).indices
        log_s, log_t = _top_k_with_tail(log_s, index), _top_k_with_tail(log_t, index)
    return generalized_jsd(log_s, log_t, settings.beta)


def sdpo_loss(
    divergence: torch.Tensor,
    distill_mask: torch.Tensor,
    settings: SDPOSettings,
    *,
    num_items: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean per-token divergence over the distilled tokens.

    `loss = sum_t m_t * min(D_t, token_clip) / max(N, 1)` with N = `num_items` if given (the distilled-token
    count of everything one optimizer step averages over, for exact gradient accumulation) else `sum m`. With no
    distilled token the loss is an exact 0 that still depends on `divergence`, so backward works.

    Args:
        divergence: (B, C) per-token divergence from `token_divergence`.
        distill_mask: (B, C) bool or 0/1, the tokens that receive the loss; other entries are ignored.
        settings: `token_clip` is read here.
        num_items: optional global normaliser, see above.

    Returns:
        The scalar loss and detached metrics under `sdpo/`.
    """
    if distill_mask.shape != divergence.shape:
        raise ValueError(f"distill_mask {tuple(distill_mask.shape)} != divergence {tuple(divergence.shape)}")
    mask = distill_mask.bool()
    per_token = divergence if settings.token_clip is None else divergence.clamp(max=settings.token_clip)
    tokens = mask.sum()
    denominator = tokens if num_items is None else torch.as_tensor(num_items, device=divergence.device)
    loss = torch.where(mask, per_token, 0).sum() / denominator.clamp(min=1)
    with torch.no_grad():
        count = tokens.clamp(min=1)
        metrics = {
            "sdpo/loss": loss.detach(),
            "sdpo/tokens": tokens.to(divergence.dtype),
            "sdpo/divergence_mean": torch.where(mask, divergence, 0).sum() / count,
        }
        if settings.token_clip is not None:
            metrics["sdpo/clipped_fraction"] = (mask & (divergence > settings.token_clip)).sum() / count
    return loss, metrics

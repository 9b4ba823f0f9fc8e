"""Channel 1: the GRPO family of policy-gradient losses on verifiable rewards (GRPO, BNPO, Dr.GRPO, DAPO).

Every formula here matches TRL 1.16 (`GRPOTrainer._generate_and_score_completions` for the advantages,
`GRPOTrainer._compute_loss` for the objective) so that runs stay comparable with the reference implementation,
with one deliberate difference: a group whose rewards are all equal gets an advantage of exactly zero. TRL
computes `(r - mean) / (std + 1e-4)`, and when the mean of equal float32 rewards rounds (six rewards of 0.3 give
`r - mean = 3e-8`) that leaves an advantage of about 3e-4 and a gradient from a group that carries no signal.

References: GRPO (DeepSeekMath, arXiv 2402.03300), Dr.GRPO (arXiv 2503.20783), DAPO (arXiv 2503.14476).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "none"]

# TRL adds this to the group std so that a group with a tiny spread does not blow the advantages up.
ADVANTAGE_EPS = 1e-4


@dataclass(frozen=True)
class GRPOSettings:
    """Hyper-parameters of the GRPO channel. Defaults are TRL 1.16's `GRPOConfig` defaults.

    Attributes:
        loss_type: how the per-token losses are averaged (see `grpo_loss`).
        eps_low: lower clip range, the ratio is clipped at `1 - eps_low`.
        eps_high: upper clip range, the ratio is clipped at `1 + eps_high`; DAPO's clip-higher uses 0.28.
        kl_beta: weight of the k3 estimate of KL(pi_theta || pi_ref); 0 disables it and needs no reference.
        kl_importance_correction: multiply the k3 term by the importance ratio pi_theta / pi_old, which makes it
            an unbiased estimate when the completions were sampled from pi_old (TRL's `use_bias_correction_kl`).
        max_completion_length: the constant divisor of `dr_grpo` (the rollout's generation limit).
        temperature: sampling temperature; log-probabilities are computed from `logits / temperature`.
    """

    loss_type: LossType = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_beta: float = 0.0
    kl_importance_correction: bool = True
    max_completion_length: int | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, got {self.loss_type!r}")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.loss_type == "dr_grpo" and (
            self.max_completion_length is None or self.max_completion_length < 1
        ):
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length; set it to a positive int")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards, consecutive groups of `group_size` completions of one prompt -> (B // group_size, group_size)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one scalar per completion), got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite; drop or score unscorable completions before this")
    return rewards.view(-1, group_size)


def _constant(groups: torch.Tensor) -> torch.Tensor:
    """(G, g) -> (G,) bool, True where every reward of the group is equal."""
    return (groups == groups[:, :1]).all(dim=1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: ScaleRewards = "group"
) -> torch.Tensor:
    """Group-relative advantages, one per completion.

    `A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-4)` with the unbiased (Bessel-corrected) std of the group, as TRL
    does; with `scale_rewards="none"` (Dr.GRPO) there is no division. Groups whose rewards are all equal get
    exactly zero (see the module docstring).

    Args:
        rewards: (B,) float, completions of one prompt contiguous: rows `[k*G, (k+1)*G)` form group k.
        group_size: G, completions per prompt.
        scale_rewards: "group" divides by the group std, "none" only centres.

    Returns:
        (B,) advantages, same dtype as `rewards`.
    """
    if scale_rewards not in ("group", "none"):
        raise ValueError(f"scale_rewards must be 'group' or 'none', got {scale_rewards!r}")
    groups = _grouped(rewards, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (groups.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return advantages.masked_fill(_constant(groups)[:, None], 0.0).reshape(-1)


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: which groups carry a learning signal.

    A group whose rewards are all equal (all solved or all failed) has zero advantage and so zero gradient;
    DAPO drops such groups and samples more prompts until the batch is full.

    Args:
        rewards: (B,) float, groups contiguous as in `group_advantages`.
        group_size: completions per prompt.

    Returns:
        (B // group_size,) bool, True for groups to keep. `keep.repeat_interleave(group_size)` gives the row mask.
    """
    return ~_constant(_grouped(rewards, group_size))


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) at tokens sampled from pi_theta.

    `exp(d) - d - 1` with `d = log pi_ref - log pi_theta`: non-negative everywhere, zero iff the log-probs are
    equal, unbiased in expectation (Schulman, "Approximating KL divergence", 2020).
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings: GRPOSettings,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    num_items: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio policy-gradient loss of one micro-batch, normalised as TRL 1.16 does.

    Per token: `r = exp(logp - old_logp)`, `loss_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`, plus
    `kl_beta * k3_kl` (times `r` if `kl_importance_correction`). Then, with m the loss mask:

    - grpo:    mean over sequences of `sum_t(m * loss_t) / max(sum_t m, 1)` (each sequence weighs the same);
               with `num_sequences`, the sum over this micro-batch's sequences divided by it
    - bnpo:    `sum(m * loss_t) / max(sum m, 1)` (token mean over the micro-batch); with `num_items`, over
               that count, as dapo
    - dr_grpo: `sum(m * loss_t) / (B * max_completion_length)` (constant divisor, no length bias), B being
               `num_sequences` when given
    - dapo:    `sum(m * loss_t) / max(num_items, 1)` where `num_items` is the loss-token count of everything
               one optimizer step averages over (all micro-batches, all ranks); it defaults to this micro-batch's
               count, which makes dapo equal to bnpo.

    Gradient accumulation: TRL divides grpo, bnpo and dr_grpo by the number of accumulation steps, which is
    exact only for micro-batches of equal size; pass the step's `num_sequences` (grpo, dr_grpo) or
    `num_items` (bnpo, dapo) instead, and the micro-batches' gradients add up to the whole batch's exactly.
    Entries outside `loss_mask` are ignored, whatever their value.

    Args:
        logps: (B, C) log pi_theta of the sampled completion tokens, differentiable.
        advantages: (B,) one per completion, or (B, C) one per token.
        loss_mask: (B, C) bool or 0/1, the tokens that count.
        settings: loss type, clip ranges, KL weight.
        old_logps: (B, C) log pi_old at sampling time; None means on-policy (`logps.detach()`, ratio 1).
        ref_logps: (B, C) reference log-probs; required when `settings.kl_beta > 0`.
        num_items: bnpo and dapo only, see above.
        num_sequences: grpo and dr_grpo only, see above.

    Returns:
        The scalar loss and detached metrics under `grpo/`.
    """
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, C), got shape {tuple(logps.shape)}")
    if loss_mask.shape != logps.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != logps shape {tuple(logps.shape)}")
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(
            f"advantages must be (B,) or (B, C); got {tuple(advantages.shape)} for {tuple(logps.shape)}"
        )
    for name, other in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if other is not None and other.shape != logps.shape:
            raise ValueError(f"{name} shape {tuple(other.shape)} != logps shape {tuple(logps.shape)}")
    if settings.kl_beta > 0 and ref_logps is None:
        raise ValueError("kl_beta > 0 needs ref_logps")
    if num_items is not None and settings.loss_type not in ("bnpo", "dapo"):
        raise ValueError(
            f"num_items is the bnpo and dapo normaliser; loss_type={settings.loss_type!r} does not use it"
        )
    if num_sequences is not None and settings.loss_type not in ("grpo", "dr_grpo"):
        raise ValueError(
            f"num_sequences is the grpo and dr_grpo normaliser; loss_type={settings.loss_type!r} does not use it"
        )

    mask = loss_mask.bool()
    # Masked entries of the reference inputs may hold anything (padding, -inf); replacing them with the current
    # log-probs keeps a NaN there from reaching the gradient through 0 * inf.
    current = logps.detach()
    old = current if old_logps is None else torch.where(mask, old_logps, current)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages

    ratio = torch.exp(logps - old)
    clipped = ratio.clamp(1 - settings.eps_low, 1 + settings.eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if settings.kl_beta > 0:
        kl = k3_kl(logps, torch.where(mask, ref_logps, current))
        if settings.kl_importance_correction:
            kl = kl * ratio
        per_token = per_token + settings.kl_beta * kl

    masked = torch.where(mask, per_token, 0)
    tokens = mask.sum()
    if settings.loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        loss = per_sequence.mean() if num_sequences is None else per_sequence.sum() / num_sequences
    elif settings.loss_type == "dr_grpo":
        sequences = logps.size(0) if num_sequences is None else num_sequences
        loss = masked.sum() / (sequences * settings.max_completion_length)
    else:  # bnpo, dapo
        denominator = tokens if num_items is None else torch.as_tensor(num_items, device=logps.device)
        loss = masked.sum() / denominator.clamp(min=1)

    with torch.no_grad():
        low = (ratio < 1 - settings.eps_low) & (adv < 0)
        high = (ratio > 1 + settings.eps_high) & (adv > 0)
        metrics = {
            "grpo/loss": loss.detach(),
            "grpo/tokens": tokens.to(logps.dtype),
            "grpo/clip_ratio/low": _masked_mean(low.to(logps.dtype), mask),
            "grpo/clip_ratio/high": _masked_mean(high.to(logps.dtype), mask),
            "grpo/clip_ratio/region": _masked_mean((low | high).to(logps.dtype), mask),
        }
        if kl is not None:
            metrics["grpo/kl"] = _masked_mean(kl, mask)
    return loss, metrics

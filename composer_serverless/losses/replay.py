"""Channel 3: trace replay as preference optimisation, DPO or SimPO.

A frozen trace gives pairs scored as completions of the same context: chosen (e.g. the majority teacher action
at a step) and rejected (the student's action). Both losses are means over pairs.

- DPO (arXiv 2305.18290, sigmoid loss): `-log sigmoid(beta * [(log pi(y_w) - log pi_ref(y_w)) -
  (log pi(y_l) - log pi_ref(y_l))])`, with `log pi(y)` summed over completion tokens only and the reference
  log-probs precomputed. Equals TRL 1.16 `DPOTrainer` with `loss_type="sigmoid"` and `precompute_ref_log_probs`.
- SimPO (arXiv 2405.14734): `-log sigmoid(beta * (avg log pi(y_w) - avg log pi(y_l)) - gamma)`, averages over
  the completion tokens, no reference model. Equals TRL 1.16 `CPOTrainer` with `loss_type="simpo"` and
  `cpo_alpha=0`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

ReplayKind = Literal["dpo", "simpo"]


@dataclass(frozen=True)
class ReplaySettings:
    """Hyper-parameters of the replay channel.

    Attributes:
        kind: "dpo" (needs precomputed reference log-probs) or "simpo" (needs none).
        dpo_beta: DPO's beta, the strength of the implicit KL to the reference (TRL default 0.1).
        simpo_beta: SimPO's reward scale; the paper uses 2 to 10, much larger than DPO's.
        simpo_gamma: SimPO's target reward margin (the paper uses 0.3 to 1.6).
    """

    kind: ReplayKind = "dpo"
    dpo_beta: float = 0.1
    simpo_beta: float = 2.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("dpo", "simpo"):
            raise ValueError(f"kind must be 'dpo' or 'simpo', got {self.kind!r}")
        if self.dpo_beta <= 0 or self.simpo_beta <= 0:
            raise ValueError(f"dpo_beta and simpo_beta must be > 0, got {self.dpo_beta}, {self.simpo_beta}")


def _check_side(name: str, logps: torch.Tensor, mask: torch.Tensor) -> None:
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise ValueError(
            f"{name} log-probs and mask must both be (P, L); got {tuple(logps.shape)}, {tuple(mask.shape)}"
        )


def _summed(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), logps, 0).sum(dim=1)


def _pair_metrics(
    loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`chosen` / `rejected` are the implicit rewards, (P,)."""
    with torch.no_grad():
        return {
            "replay/loss": loss.detach(),
            "replay/pairs": torch.tensor(float(chosen.numel()), device=chosen.device),
            "replay/reward_chosen": chosen.mean(),
            "replay/reward_rejected": rejected.mean(),
            "replay/reward_margin": (chosen - rejected).mean(),
            "replay/reward_accuracy": (chosen > rejected).to(chosen.dtype).mean(),
        }


def dpo_loss(
    chosen_logps: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sigmoid DPO loss, mean over pairs. At pi = pi_ref it is exactly log 2.

    Args:
        chosen_logps: (P, Lw) per-token log pi of the chosen completion tokens; entries outside the mask ignored.
        chosen_mask: (P, Lw) bool or 0/1, the chosen completion tokens.
        rejected_logps: (P, Ll) per-token log pi of the rejected completion.
        rejected_mask: (P, Ll).
        ref_chosen_logps: (P,) reference log-prob of each chosen completion, summed over its tokens.
        ref_rejected_logps: (P,) the same for the rejected completions.
        beta: DPO beta.

    Returns:
        The scalar loss and detached metrics under `replay/`; rewards are `beta * (log pi - log pi_ref)`.
    """
    _check_side("chosen", chosen_logps, chosen_mask)
    _check_side("rejected", rejected_logps, rejected_mask)
    pairs = chosen_logps.size(0)
    if (
        rejected_logps.size(0) != pairs
        or ref_chosen_logps.shape != (pairs,)
        or ref_rejected_logps.shape != (pairs,)
    ):
        raise ValueError("chosen, rejected and both reference tensors must hold the same number of pairs")
    chosen = beta * (_summed(chosen_logps, chosen_mask) - ref_chosen_logps)
    rejected = beta * (_summed(rejected_logps, rejected_mask) - ref_rejected_logps)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, _pair_metrics(loss, chosen, rejected)


def simpo_loss(
    chosen_logps: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    *,
    beta: float,
    gamma: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO loss, mean over pairs: length-normalised log-likelihood margin with target margin gamma.

    An empty completion (mask all zero) has average log-prob 0 rather than 0 / 0.

    Args:
        chosen_logps, chosen_mask, rejected_logps, rejected_mask: as in `dpo_loss`.
        beta: reward scale.
        gamma: target margin.

    Returns:
        The scalar loss and detached metrics under `replay/`; rewards are `beta * avg log pi`.
    """
    _check_side("chosen", chosen_logps, chosen_mask)
    _check_side("rejected", rejected_logps, rejected_mask)
    if rejected_logps.size(0) != chosen_logps.size(0):
        raise ValueError("chosen and rejected must hold the same number of pairs")
    chosen = beta * _summed(chosen_logps, chosen_mask) / chosen_mask.sum(dim=1).clamp(min=1)
    rejected = beta * _summed(rejected_logps, rejected_mask) / rejected_mask.sum(dim=1).clamp(min=1)
    loss = -F.logsigmoid(chosen - rejected - gamma).mean()
    return loss, _pair_metrics(loss, chosen, rejected)


def replay_loss(
    chosen_logps: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    settings: ReplaySettings,
    *,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`dpo_loss` or `simpo_loss` as `settings.kind` says; DPO requires both reference tensors."""
    if settings.kind == "simpo":
        return simpo_loss(
            chosen_logps,
            chosen_mask,
            rejected_logps,
            rejected_mask,
            beta=settings.simpo_beta,
            gamma=settings.simpo_gamma,
        )
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError("replay kind 'dpo' needs ref_chosen_logps and ref_rejected_logps (precompute them)")
    return dpo_loss(
        chosen_logps,
        chosen_mask,
        rejected_logps,
        rejected_mask,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=settings.dpo_beta,
    )

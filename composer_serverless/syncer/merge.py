"""The syncer's merge arithmetic: how much each contribution counts, how contributions are combined, how long
to wait for more. Pure functions over torch tensors; no store, no model.

A contribution is one learner's pseudo-gradient of a fragment (its progress not sent yet: ``parameters at its
last contribution or adoption - its local parameters``), with the global version it holds and the tokens and
inner steps it trained on since its last contribution.

**Weights** (Decoupled DiLoCo, Douillard et al. 2026): ``"tokens"`` weighs a contribution by
``tokens ** 2 / steps``, quantity (tokens) times quality (tokens per step: a learner that took bigger batches
took better steps); ``"equal"`` gives each 1. Either is then multiplied by a staleness factor of the
contribution's age, ``syncer's version - base version``:

- beyond ``max_age`` the contribution is dropped (weight ``None``): the common guard (an asynchronous
  DiLoCo over a shared filesystem, Forgather's docs: staleness above 5-10 hurts);
- otherwise it is discounted by ``1 / (1 + discount * age)``.

The default is drop beyond ``DEFAULT_MAX_AGE`` versions and no discount (``discount = 0``): Async Local-SGD
(Liu et al. 2024) measured polynomial discounts, dropping and delay compensation and found they barely
helped, while the bound keeps a learner that was away for long (a stall, a lost link) from pulling the
global back. ``DEFAULT_MAX_AGE = 8`` keeps every learner of the usual cases: with 4 learners, a quorum of 1
and equal speeds a contribution is about 3 versions old, one from a learner at half speed about 6.

**Averages**, per tensor: ``"mean"``, the weighted mean; with equal weights (any equal value) it is computed
exactly as lock-step DiLoCo's reducer does (``rendezvous/allreduce.py``: the contributions added in order
into an fp32 zero tensor, then ``div_`` by their count), so the decoupled mode with equal learners is
bit-identical to lock-step. ``"rda"``, radial-directional averaging: the weighted mean of the contributions'
norms times the direction of the weighted mean of their unit vectors. Per-learner pseudo-gradients are
nearly orthogonal, so a plain mean of M of them shrinks to about 1/sqrt(M) of their norm and the outer
learning rate would have to change with M; RDA keeps the norm. The embeddings (the caller names them) are
averaged plainly, as in the paper: their rows are touched by few learners each, so their directions are not
comparable.

**Grace**: after the quorum has arrived, wait ``min(bound, gamma * slack)`` for more, where
``slack = tau * t_step - (t_quorum + t_sync)`` is the time the overlap of ``tau`` inner steps hides beyond
waiting for the quorum and the merge itself; never negative. The overlap is the earliest contributor's: it
published, trains its next ``tau`` steps meanwhile, and should find the merge done when it publishes again, so
``t_quorum`` runs from the first contribution in hand, not from when the syncer began waiting (time with
nothing to merge hides nothing and costs no one).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import torch

Weighting = Literal["tokens", "equal"]
Average = Literal["mean", "rda"]

DEFAULT_MAX_AGE = 8
DEFAULT_DISCOUNT = 0.0


# --- weights -----------------------------------------------------------------------------------------------


def base_weight(tokens: int, steps: int, weighting: Weighting) -> float:
    """A contribution's weight before staleness: ``tokens ** 2 / steps`` for ``"tokens"``, 1 for ``"equal"``.

    Raises:
        ValueError: ``tokens`` or ``steps`` is not positive, or ``weighting`` is unknown.
    """
    if tokens <= 0 or steps <= 0:
        raise ValueError(f"a contribution needs tokens > 0 and steps > 0, got tokens={tokens}, steps={steps}")
    if weighting == "tokens":
        return tokens * (tokens / steps)
    if weighting == "equal":
        return 1.0
    raise ValueError(f"unknown weighting {weighting!r}: use 'tokens' or 'equal'")


def staleness_factor(age: int, *, max_age: int | None, discount: float) -> float | None:
    """The factor of a contribution ``age`` versions old: ``1 / (1 + discount * age)``, or ``None`` (dropped)
    when ``age > max_age`` (``max_age = None``: no bound) or ``age < 0``.

    A negative age is a contribution from a global newer than the syncer's, which only a syncer state older
    than what the learners saw can produce; it is dropped rather than merged into a global it was not
    computed from (as torchft's asynchronous DiLoCo rejects a push whose base is ahead of the server's).

    Raises:
        ValueError: ``max_age`` or ``discount`` is negative.
    """
    if max_age is not None and max_age < 0:
        raise ValueError(f"max_age must be >= 0 (or None for no bound), got {max_age}")
    if not discount >= 0:
        raise ValueError(f"discount must be >= 0, got {discount}")
    if age < 0 or (max_age is not None and age > max_age):
        return None
    return 1.0 / (1.0 + discount * age)


def contribution_weight(
    *,
    tokens: int,
    steps: int,
    age: int,
    weighting: Weighting,
    max_age: int | None = DEFAULT_MAX_AGE,
    discount: float = DEFAULT_DISCOUNT,
) -> float | None:
    """``base_weight * staleness_factor``; ``None`` when the contribution is dropped for its age."""
    factor = staleness_factor(age, max_age=max_age, discount=discount)
    weight = base_weight(tokens, steps, weighting)
    return None if factor is None else weight * factor


# --- averages ----------------------------------------------------------------------------------------------


def merge(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], average: Average = "mean"
) -> torch.Tensor:
    """The merged pseudo-gradient of one tensor (fp32, a new tensor): see the module docstring.

    Args:
        deltas: the contributions' pseudo-gradients of this tensor, in the order they are to be summed (the
            lock-step reducer sums in rank order).
        weights: one positive weight per contribution (``contribution_weight``); dropped ones are not passed.
        average: ``"mean"`` or ``"rda"``.

    Raises:
        ValueError: no contribution, a weight that is not positive and finite, shapes that differ, or an
            unknown ``average``.
    """
    _check(deltas, weights)
    if average == "mean":
        return _mean(deltas, weights)
    if average == "rda":
        return _radial_directional(deltas, weights)
    raise ValueError(f"unknown average {average!r}: use 'mean' or 'rda'")


def merge_tensors(
    contributions: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    average: Average = "mean",
    plain: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """``merge`` of every named tensor of the contributions; the tensors named in ``plain`` (the embeddings)
    are averaged with ``"mean"`` whatever ``average`` is.

    Raises:
        ValueError: as ``merge``, or the contributions do not all hold the same names.
    """
    if not contributions:
        raise ValueError("nothing to merge: no contribution")
    names = list(contributions[0])
    for i, contribution in enumerate(contributions[1:], start=1):
        if set(contribution) != set(names):
            raise ValueError(
                f"contribution {i} holds {sorted(contribution)}, contribution 0 holds {sorted(names)}: "
                "every contribution of a fragment must hold the same tensors"
            )
    return {
        name: merge([c[name] for c in contributions], weights, "mean" if name in plain else average)
        for name in names
    }


def _check(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    if not deltas:
        raise ValueError("nothing to merge: no contribution")
    if len(weights) != len(deltas):
        raise ValueError(f"{len(deltas)} contributions but {len(weights)} weights")
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise ValueError(f"weights must be positive and finite, got {bad}: drop a contribution instead")
    shapes = {tuple(d.shape) for d in deltas}
    if len(shapes) != 1:
        raise ValueError(f"contributions of one tensor have different shapes: {sorted(shapes)}")


def _mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The weighted mean. Equal weights take the lock-step reducer's arithmetic (sum in order into fp32
    zeros, divide by the count), bit for bit; others add each contribution scaled by its share of the total
    weight, which keeps tokens ** 2 / steps weights (1e10 and more) far from fp32's range."""
    total = torch.zeros(deltas[0].shape, dtype=torch.float32)
    if len(set(weights)) == 1:
        for delta in deltas:
            total.add_(delta)
        return total.div_(len(deltas))
    whole = math.fsum(weights)
    for delta, weight in zip(deltas, weights, strict=True):
        total.add_(delta, alpha=weight / whole)
    return total


def _norm(values: torch.Tensor) -> float:
    """The L2 norm, accumulated in fp64: exact enough for any finite fp32 values, and no overflow."""
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


def _radial_directional(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The weighted mean of the norms times the unit direction of the weighted mean of the unit vectors.

    A zero contribution (a learner that did not move this tensor) counts in the mean of the norms, with norm
    0, and adds no direction. When the unit vectors cancel (or every contribution is zero) there is no
    direction to follow, and the result is zero."""
    whole = math.fsum(weights)
    norms = [_norm(delta) for delta in deltas]
    radius = math.fsum(w * n for w, n in zip(weights, norms, strict=True)) / whole
    direction = torch.zeros(deltas[0].shape, dtype=torch.float32)
    for delta, weight, norm in zip(deltas, weights, norms, strict=True):
        if norm > 0:
            direction.add_(delta, alpha=weight / whole / norm)
    length = _norm(direction)
    if radius == 0 or length == 0:
        return direction.zero_()
    return direction.mul_(radius / length)


# --- grace -------------------------------------------------------------------------------------------------


def grace_window(
    *, tau: int, step_s: float, quorum_s: float, sync_s: float, gamma: float, bound_s: float
) -> float:
    """How long to wait for more contributions once the quorum is in: ``min(bound_s, gamma * slack)`` with
    ``slack = tau * step_s - (quorum_s + sync_s)``, never negative.

    Args:
        tau: the inner steps a learner runs while its contribution is merged (the overlap).
        step_s: the time of one inner step.
        quorum_s: from the first contribution in hand to the quorum.
        sync_s: the time a merge and its broadcast take.
        gamma: the share of the slack to spend waiting, in [0, 1): below 1 so the wait stays hidden.
        bound_s: the longest wait whatever the slack (``math.inf``: none).

    Raises:
        ValueError: a negative time, ``tau`` or ``bound_s``, or ``gamma`` outside [0, 1).
    """
    if min(tau, step_s, quorum_s, sync_s, bound_s) < 0:
        raise ValueError(
            f"grace_window takes non-negative values, got tau={tau}, step_s={step_s}, "
            f"quorum_s={quorum_s}, sync_s={sync_s}, bound_s={bound_s}"
        )
    if not 0 <= gamma < 1:
        raise ValueError(f"gamma must be in [0, 1) so the wait stays within the overlap, got {gamma}")
    slack = tau * step_s - (quorum_s + sync_s)
    return min(bound_s, gamma * max(slack, 0.0))

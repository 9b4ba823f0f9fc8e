"""pass@k of a held-out prompt: the chance that at least one of k of its completions passes.

Estimated from n >= k samples of which c pass, without bias (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", Eq. 1): ``1 - C(n - c, k) / C(n, k)``, the share of the k-subsets of the n samples
that hold a passing one. Taking the first k samples instead would throw n - k of them away and be noisier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k from ``n`` samples of which ``c`` pass.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n, got n = {n}, c = {c}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_pass_at_k(values: Sequence[float | None], k: int, threshold: float) -> float | None:
    """pass@k of one prompt whose completions scored ``values`` (None where the reward does not apply): a
    completion passes at ``threshold`` or above; None when fewer than k of them were scored."""
    scored = [v for v in values if v is not None]
    if len(scored) < k:
        return None
    return pass_at_k(len(scored), sum(v >= threshold for v in scored), k)

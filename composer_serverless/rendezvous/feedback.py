"""Error feedback: what a replica's sparse inputs left out, added to its next pseudo-gradient of the fragment.

The sparse codec (``sparse.py``) sends about 1.5 % of each chunk; without feedback the other 98.5 % would be
lost every sync and small coordinates would never move. With it, a replica sends ``C(delta + e)`` and keeps
``e = delta + e - C(delta + e)`` (SparseLoCo, arXiv 2508.15706; Karimireddy et al. 2019), so every part of
every pseudo-gradient reaches the average eventually, and the error stays bounded.

The residual is one fp32 tensor per fragment (per rank of an FSDP replica: the rank's part of the fragment's
bucket), in host memory: it is as large as the fragment, and on an accelerator it would take the memory the
inner step needs. It is this replica's own: it goes into its own saved state (``state.py``), so a resume
restarts from the residual the run left, bit-exactly. The residual moves only when a sync commits with this
replica's inputs averaged; a sync that fails is retried from the same residual (and re-encodes the same
bytes), and one that averaged without this replica's input (it arrived late, or an input was rejected)
leaves it as it was. A replica that loads a published state without its own state of that round (it fell
behind, or lost its saved state) starts from zeros: what its residual held is gone, as a dead replica's is,
and the run goes on without it.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Each fragment's residual, by fragment index."""

    def __init__(self) -> None:
        self.residuals: dict[int, torch.Tensor] = {}

    def residual(self, fragment: int, numel: int) -> torch.Tensor:
        """The residual to add to ``fragment``'s next pseudo-gradient of ``numel`` values (zeros at first)."""
        kept = self.residuals.get(fragment)
        if kept is None or kept.numel() != numel:
            kept = self.residuals[fragment] = torch.zeros(numel)
        return kept

    def keep(self, fragment: int, residual: torch.Tensor) -> None:
        """The residual after a sync that averaged this replica's inputs."""
        self.residual(fragment, residual.numel()).copy_(residual)

    def clear(self) -> None:
        """Forget every residual: the local state it belongs with was replaced by a published one."""
        self.residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(f): r.clone() for f, r in sorted(self.residuals.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Continue from ``state_dict``'s residuals; none (an own state saved without them): zeros."""
        self.residuals = {int(f): r.to(torch.float32).clone() for f, r in (state or {}).items()}

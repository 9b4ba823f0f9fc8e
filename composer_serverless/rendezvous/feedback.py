"""Error feedback: what a replica's sparse inputs left out, sent again in later syncs.

The sparse codec (``sparse.py``) sends about 1.5 % of each chunk; without feedback the other 98.5 % would be
lost every sync and small coordinates would never move. With it, what a replica's inputs did not send, ``e``,
is not lost (SparseLoCo, arXiv 2508.15706; Karimireddy et al. 2019), in one of two ways
(``diloco.error_feedback``):

* ``resend`` (the default): the replica sends ``C(delta + e)`` and keeps ``e = delta + e - C(delta + e)``; its
  local weights restart from the global ones, as without feedback.
* ``reset`` (CSER's error reset, Xie et al. 2020): it sends ``C(delta)`` and its local weights restart from
  the global ones minus ``e = delta - C(delta)`` (``host_diloco.offset_local``), so the next pseudo-gradient,
  global minus local, carries ``e`` with the new progress, and the replica trains on from its own unsent
  progress. Measured on the demo: 14 % above fp32 at H = 10 against resend's 22 %, but at H = 50 the global
  model ended worse than it started (the local weights drift from a global model that gets a few
  coordinates at a time), where resend's is 33 % above fp32 (docs/RESULTS.md, section 17).

The residual is one fp32 tensor per fragment (per rank of an FSDP replica: the rank's part of the fragment's
bucket), in host memory: it is as large as the fragment, and on an accelerator it would take the memory the
inner step needs. It is this replica's own: it goes into its own saved state (``state.py``), beside the local
weights that differ from the global ones (with ``reset``, all of them), so a resume continues bit-exactly.
The residual moves only when a sync commits with this replica's inputs averaged, shard by shard: a sync that
fails leaves it as it was, and so does one that averaged without this replica's input (it arrived late, or the
outlier rule left it out, which it does in every shard alike); a shard whose average left out an input that
could not be read keeps its part of the old residual, the shards that averaged this replica's input take the
new one. A retried sync accounts for the inputs an earlier attempt stored, which are what the sync averages.

A shard's owner re-sparsifies the average it publishes (``allreduce.py``), and keeps what that leaves out:
its second residual, of its own shard's size, is added to the next average it publishes (bidirectional error
feedback: without it, up to N - 1 of every N entries the inputs carried would be lost at the owner for good).
A substitute or a rescuer that reduces another replica's shard publishes that average without feedback and
keeps nothing: the shard's owner keeps its residual for its next turn. A replica that loads a published state
without its own state of that round (it fell behind, or lost its saved state) starts from zeros: what its
residual held is gone, as a dead replica's is, and the run goes on without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Residuals:
    """One fragment's residuals on one replica: of its inputs (the fragment's size), and of the average it
    publishes as its shard's owner (its shard's size)."""

    inputs: torch.Tensor | None
    owned: torch.Tensor | None


def carried_share(sending: float, unsent: float) -> float | None:
    """The share of the squared norm of what the inputs were to carry (the pseudo-gradient plus the residual,
    of L2 norm ``sending``) that they carried, ``1 - (unsent / sending)^2``, from the norm ``unsent`` of what
    they left out; None for an all-zero input. Norms, not tensors: the exchange has the first already (it is in
    every input's header), and a fragment-sized fp64 copy to square would be gigabytes on a real model.

    Why it is reported: it is what a round of a lossy codec actually moved. In [0, 1] for the sparse codec,
    whose chunk magnitudes are least-squares fits (no worse than sending zeros); at 1.5 % of a Gaussian's
    entries it would be about 0.12, and the more a pseudo-gradient's mass sits in few coordinates, the more
    top-k carries (docs/RESULTS.md, section 17, against the model's width)."""
    if sending == 0:
        return None
    return 1.0 - (unsent / sending) ** 2


class ErrorFeedback:
    """Each fragment's residuals, by fragment index; with ``reset``, the inputs' residual is kept in the local
    weights instead of being added to the next pseudo-gradient."""

    def __init__(self, *, reset: bool = False) -> None:
        self.reset = reset
        self.residuals: dict[int, Residuals] = {}

    def to_send(self, fragment: int, numel: int, owned: int) -> Residuals:
        """What the exchange adds: the inputs' residual to the pseudo-gradient (none with ``reset``: the local
        weights hold it, so the pseudo-gradient does), and the owned residual to the published average."""
        kept = self.residual(fragment, numel, owned)
        return Residuals(None if self.reset else kept.inputs, kept.owned)

    def residual(self, fragment: int, numel: int, owned: int) -> Residuals:
        """``fragment``'s residuals: of its pseudo-gradient of ``numel`` values, and of the average of the
        ``owned`` values of its shard this replica owns (zeros at first)."""
        kept = self.residuals.get(fragment)
        if (
            kept is None
            or kept.inputs is None
            or kept.owned is None
            or kept.inputs.numel() != numel
            or kept.owned.numel() != owned
        ):
            kept = self.residuals[fragment] = Residuals(torch.zeros(numel), torch.zeros(owned))
        return kept

    def keep(
        self,
        fragment: int,
        inputs: torch.Tensor | None,
        owned: torch.Tensor | None,
        averaged: list[tuple[int, int]] | None = None,
    ) -> None:
        """The residuals after a sync that committed: of the inputs where they were averaged (``averaged``, the
        [start, end) spans of the shards whose average holds this replica's input; None: all of them), of the
        owned shard's average if this replica published it; None leaves one as it was. A shard whose average
        left this replica's input out (unreadable there) keeps its old residual, as a sync that averaged none
        of its inputs does."""
        if fragment not in self.residuals:
            raise KeyError(f"fragment {fragment} has no residual to update")
        kept = self.residuals[fragment]
        assert kept.inputs is not None and kept.owned is not None
        if inputs is not None:
            for start, end in [(0, inputs.numel())] if averaged is None else averaged:
                kept.inputs[start:end].copy_(inputs[start:end])
        if owned is not None:
            kept.owned.copy_(owned)

    def clear(self) -> None:
        """Forget every residual: the local state it belongs with was replaced by a published one."""
        self.residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for f, r in sorted(self.residuals.items()):
            assert r.inputs is not None and r.owned is not None
            state[f"{f}/inputs"] = r.inputs.clone()
            state[f"{f}/owned"] = r.owned.clone()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Continue from ``state_dict``'s residuals; none (an own state saved without them): zeros."""
        state = state or {}
        fragments = {key.split("/")[0] for key in state}
        self.residuals = {
            int(f): Residuals(
                state[f"{f}/inputs"].to(torch.float32).clone(), state[f"{f}/owned"].to(torch.float32).clone()
            )
            for f in fragments
        }

"""Micro-batches of one step of the three-channel loss, whose gradients add up to the whole batch's.

Activation memory follows the rows one forward holds, so a step of P prompts x G completions, its teacher pass
and its preference pairs is run as micro-batches of at most ``rows`` completions (and ``rows // 2`` pairs: a
pair is two sequences), each backpropagated before the next. For the sum of their gradients to be the whole
batch's, each micro-batch is normalised by the whole step's counts, not its own:

* token-normalised channels (GRPO's ``bnpo`` and ``dapo``, SDPO) take the step's token count as
  ``num_items``;
* row-normalised channels (GRPO's ``grpo`` and ``dr_grpo``, replay) take the step's sequence or pair count
  (``num_sequences``, ``num_pairs``), so a micro-batch's mean over its rows weighs its share of them.

A sharded replica's ranks are one step's parts too: ``across_ranks`` gives a rank's share the replica's counts
(one sum over the ranks), which ``split`` then keeps for its micro-batches.

Metrics come back per micro-batch; ``weighted`` makes them parts that add up to the step's: a loss or a count
is the sum of its micro-batches', any other metric (a clip ratio, a reward margin) their mean weighted by rows
(pairs for ``replay/``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch

from composer_serverless.losses.batches import LossBatch

# Metrics that add up over micro-batches: the losses (each micro-batch's is its share) and the counts.
_SUMMED_SUFFIXES = ("loss", "loss/total", "/tokens", "/pairs")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch and its shares of the step's completions and pairs (for ``weighted``)."""

    batch: LossBatch
    rl_share: float
    replay_share: float


def split(batch: LossBatch, rows: int | None) -> list[MicroBatch]:
    """``batch`` as micro-batches of at most ``rows`` completions and ``max(1, rows // 2)`` pairs, each
    carrying the step's counts; one micro-batch (``batch`` itself) when it fits or ``rows`` is None."""
    rl, hint, replay = batch.rl, batch.hint, batch.replay
    completions = 0 if rl is None else rl.completion_ids.size(0)
    pairs = 0 if replay is None else replay.prompt_ids.size(0)
    pair_rows = None if rows is None else max(1, rows // 2)
    if rows is None or (completions <= rows and pairs <= pair_rows):
        return [MicroBatch(batch, 1.0, 1.0)]
    assert pair_rows is not None
    count = max(math.ceil(completions / rows), math.ceil(pairs / pair_rows))
    batch = _with_counts(batch, rl.scored_mask().sum() if rl is not None else 0, completions, pairs)
    rl, hint, replay = batch.rl, batch.hint, batch.replay
    parts = []
    for k in range(count):
        rl_rows = slice(k * rows, (k + 1) * rows)
        pair_slice = slice(k * pair_rows, (k + 1) * pair_rows)
        part_rl = rows_of(rl, rl_rows) if rl is not None and k * rows < completions else None
        part_hint = rows_of(hint, rl_rows) if part_rl is not None and hint is not None else None
        part_replay = rows_of(replay, pair_slice) if replay is not None and k * pair_rows < pairs else None
        parts.append(
            MicroBatch(
                LossBatch(rl=part_rl, hint=part_hint, replay=part_replay),
                rl_share=0.0 if part_rl is None else part_rl.completion_ids.size(0) / completions,
                replay_share=0.0 if part_replay is None else part_replay.prompt_ids.size(0) / pairs,
            )
        )
    return parts


def _with_counts(
    batch: LossBatch,
    tokens: int | torch.Tensor,
    completions: int,
    pairs: int,
    *,
    distilled: int | None = None,
) -> LossBatch:
    """``batch`` carrying the step's counts where it does not carry them already (``across_ranks`` set the
    replica's): its scored ``tokens``, ``completions``, ``pairs``, and the ``distilled`` tokens (None: the
    hint's own)."""
    rl, hint, replay = batch.rl, batch.hint, batch.replay
    if rl is not None and rl.num_items is None:
        rl = dataclasses.replace(rl, num_items=tokens, num_sequences=completions)
    if hint is not None and hint.num_items is None:
        count = hint.distill_mask.bool().sum() if distilled is None else distilled
        hint = dataclasses.replace(hint, num_items=count)
    if replay is not None and replay.num_pairs is None:
        replay = dataclasses.replace(replay, num_pairs=pairs)
    return LossBatch(rl=rl, hint=hint, replay=replay)


def across_ranks(batch: LossBatch, total: Callable[[list[float]], list[float]]) -> LossBatch:
    """One rank's share of a sharded replica's step, carrying the replica's counts (``total`` sums over
    its ranks, a collective), so that the ranks' losses, averaged by FSDP and times G, are the replica's.

    A hint batch is passed through the model on every rank when any rank distils a token (``always``), and
    dropped on every rank when none does: the ranks' forward passes stay in step."""
    rl, hint, replay = batch.rl, batch.hint, batch.replay
    on_device = [] if rl is None else [rl.scored_mask().sum()]
    if rl is not None and hint is not None:
        on_device.append(hint.distill_mask.bool().sum())
    read = torch.stack(on_device).tolist() if on_device else []  # the host waits once
    local = read + [0] * (2 - len(read))
    counts = local + [
        0 if rl is None else rl.completion_ids.size(0),
        0 if replay is None else replay.prompt_ids.size(0),
    ]
    tokens, distilled, completions, pairs = (int(c) for c in total(counts))
    if hint is not None:
        hint = dataclasses.replace(hint, always=True) if distilled else None
    shared = LossBatch(rl=rl, hint=hint, replay=replay)
    return _with_counts(shared, tokens, completions, pairs, distilled=distilled)


def rows_of(part, rows: slice):  # type: ignore[no-untyped-def]
    """The rows ``rows`` of a batch part: every (B, ...) tensor field sliced, counts kept."""
    fields = {
        f.name: value[rows]
        for f in dataclasses.fields(part)
        if isinstance(value := getattr(part, f.name), torch.Tensor) and value.dim() >= 1
    }
    return dataclasses.replace(part, **fields)


def weighted(
    micro: MicroBatch, metrics: Mapping[str, torch.Tensor | float], scale: float = 1.0
) -> dict[str, torch.Tensor | float]:
    """A micro-batch's metrics as its parts of the step's, which the step's sum over micro-batches adds up:
    a loss or a count as it is (times ``scale``: G on one of G ranks, where it is a share of the replica's),
    any other metric weighted by the micro-batch's share of rows (pairs for ``replay/``), so that the sum is
    their row-weighted mean."""
    out: dict[str, torch.Tensor | float] = {}
    for name, value in metrics.items():
        if name.endswith(_SUMMED_SUFFIXES):
            out[name] = value * scale
        else:
            out[name] = value * (micro.replay_share if name.startswith("replay/") else micro.rl_share)
    return out

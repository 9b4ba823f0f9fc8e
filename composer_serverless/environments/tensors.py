"""The loss's view of episodes: the GRPO batch with only the model's tokens scored, and the SDPO teacher
sequences with the hint inserted at the error site.

The whole trajectory after the prompt is the completion (``completion_mask``), so log-probabilities are taken
over it in one pass with every earlier turn in context; ``loss_mask`` keeps the model's tokens only, so
template and tool tokens carry no gradient. For SDPO, the teacher reads ``[prompt, trajectory up to the site,
hint, the rest of the trajectory]`` and the term covers the model's tokens after the site only
(``HintBatch.teacher_positions`` says where each trajectory token landed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from composer_serverless.environments.episodes import Episode
from composer_serverless.losses.batches import HintBatch, RLBatch


def trajectory_tensors(
    episodes: Sequence[Episode], pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """``prompt_ids``/``prompt_mask`` (left-padded), ``completion_ids``/``completion_mask`` (right-padded, the
    whole trajectory) and ``loss_mask`` (the model's tokens), as ``RLBatch`` takes them."""
    width_p = max(len(e.prompt_ids) for e in episodes)
    width_c = max(max(len(e.ids) for e in episodes), 1)

    def left(row: Sequence[int], fill: int) -> list[int]:
        return [fill] * (width_p - len(row)) + list(row)

    def right(row: Sequence[int], fill: int) -> list[int]:
        return list(row) + [fill] * (width_c - len(row))

    def tensor(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=device)

    return {
        "prompt_ids": tensor([left(e.prompt_ids, pad_id) for e in episodes]),
        "prompt_mask": tensor([left([1] * len(e.prompt_ids), 0) for e in episodes]),
        "completion_ids": tensor([right(e.ids, pad_id) for e in episodes]),
        "completion_mask": tensor([right([1] * len(e.ids), 0) for e in episodes]),
        "loss_mask": tensor([right([int(m) for m in e.model], 0) for e in episodes]),
    }


def site_hint_batch(
    episodes: Sequence[Episode],
    hints: Sequence[tuple[int, list[int]] | None],
    rl: RLBatch,
    pad_id: int,
    *,
    always: bool = False,
) -> HintBatch | None:
    """The teacher sequences of ``rl``'s episodes, each hinted at its site.

    Args:
        hints: per episode, ``(position in the trajectory, the hint's tokens)``, None where there is no hint.
        always: build the batch even when no episode has a hint (see ``HintBatch.always``).

    Returns:
        None when no episode has a hint, unless ``always``.
    """
    if all(h is None for h in hints) and not always:
        return None
    rows, positions, distill = [], [], []
    width_c = rl.completion_ids.size(1)
    for episode, hint in zip(episodes, hints, strict=True):
        site, hint_ids = hint if hint is not None else (len(episode.ids), [])
        ids = episode.ids
        rows.append(episode.prompt_ids + ids[:site] + hint_ids + ids[site:])
        start = len(episode.prompt_ids)
        row_positions = [start + j + (len(hint_ids) if j >= site else 0) for j in range(len(ids))]
        # Padding columns point at the row's first token: read nowhere (their distill mask is 0).
        positions.append(row_positions + [0] * (width_c - len(ids)))
        distill.append(
            [int(hint is not None and j >= site and episode.model[j]) for j in range(len(ids))]
            + [0] * (width_c - len(ids))
        )
    width_t = max(len(r) for r in rows)
    device = rl.completion_ids.device
    return HintBatch(
        teacher_ids=torch.tensor([r + [pad_id] * (width_t - len(r)) for r in rows], device=device),
        teacher_mask=torch.tensor([[1] * len(r) + [0] * (width_t - len(r)) for r in rows], device=device),
        teacher_positions=torch.tensor(positions, device=device),
        distill_mask=torch.tensor(distill, device=device),
        always=always,
    )

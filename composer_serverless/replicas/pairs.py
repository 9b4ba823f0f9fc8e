"""Preference pairs as replay batches: tokenised once, reference log-probabilities fixed once, served in a
resumable shuffled order.

Each completion is scored as its tokens followed by EOS, like a rollout that stopped, so the replay channel
also teaches where an answer ends. DPO needs log pi_ref of both completions. Pairs that carry them
(`chosen_ref_logp`, `rejected_ref_logp`, computed under the same convention) use them as given; for the
others they are computed here, once, with the model the objective is built with, which must be the run's
initial model (TRL's `precompute_ref_log_probs`). That costs one forward pass per pair and no second copy of
the model.
SimPO needs no reference, and nothing is computed for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from composer_serverless.losses.batches import ReplayBatch
from composer_serverless.losses.logprobs import completion_logprobs
from composer_serverless.replicas.records import Cycle, PreferencePair

logger = logging.getLogger(__name__)

# Pairs per forward pass when computing reference log-probabilities.
REFERENCE_BATCH = 64


def _left(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _right(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


class ReplayPairs:
    """This replica's preference pairs, `per_step` at a time as `ReplayBatch`es.

    Args:
        pairs: the shard's pairs.
        tokenizer: the run's tokenizer.
        per_step: pairs per batch.
        seed: order of the passes over the pairs.
        reference: the initial model, to compute missing reference log-probs; None for SimPO (none needed).
        chunk_tokens: LM-head chunk size for that computation.
        render: how a pair's prompt text becomes the model's input (a chat template's user turn, or as is).
    """

    def __init__(
        self,
        pairs: Sequence[PreferencePair],
        tokenizer: Any,
        *,
        per_step: int,
        seed: int,
        reference: nn.Module | None,
        chunk_tokens: int,
        render: Callable[[str], str] = lambda text: text,
    ) -> None:
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self._prompts = [tokenizer(render(p.prompt))["input_ids"] for p in pairs]
        self._chosen = [tokenizer(p.chosen, add_special_tokens=False)["input_ids"] + [eos] for p in pairs]
        self._rejected = [tokenizer(p.rejected, add_special_tokens=False)["input_ids"] + [eos] for p in pairs]
        empty = next((p for p, ids in zip(pairs, self._prompts, strict=True) if not ids), None)
        if empty is not None:
            raise ValueError(f"{empty.source}: the prompt encodes to no tokens")
        self._pad = pad
        self._per_step = per_step
        self._cycle = Cycle(len(pairs), seed)
        self._refs: torch.Tensor | None = None
        if reference is not None:
            self._refs = self._reference_logps(pairs, reference, chunk_tokens)

    def __len__(self) -> int:
        return len(self._prompts)

    def _batch(self, index: Sequence[int], device: torch.device) -> ReplayBatch:
        prompt_ids, prompt_mask = _left([self._prompts[i] for i in index], self._pad)
        chosen_ids, chosen_mask = _right([self._chosen[i] for i in index], self._pad)
        rejected_ids, rejected_mask = _right([self._rejected[i] for i in index], self._pad)
        refs = None if self._refs is None else self._refs[list(index)].to(device)
        return ReplayBatch(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            chosen_ids=chosen_ids.to(device),
            chosen_mask=chosen_mask.to(device),
            rejected_ids=rejected_ids.to(device),
            rejected_mask=rejected_mask.to(device),
            ref_chosen_logps=None if refs is None else refs[:, 0],
            ref_rejected_logps=None if refs is None else refs[:, 1],
        )

    def _reference_logps(
        self, pairs: Sequence[PreferencePair], model: nn.Module, chunk_tokens: int
    ) -> torch.Tensor:
        """(N, 2) log pi_ref of (chosen, rejected): given values where the pair has them, else computed."""
        given = [(p.chosen_ref_logp, p.rejected_ref_logp) for p in pairs]
        refs = torch.tensor([g if g[0] is not None else (0.0, 0.0) for g in given], dtype=torch.float32)
        missing = [i for i, g in enumerate(given) if g[0] is None]
        if not missing:
            return refs
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(missing), REFERENCE_BATCH):
                    index = missing[start : start + REFERENCE_BATCH]
                    batch = self._batch(index, device)
                    for column, (ids, mask) in enumerate(
                        ((batch.chosen_ids, batch.chosen_mask), (batch.rejected_ids, batch.rejected_mask))
                    ):
                        logps = completion_logprobs(
                            model, batch.prompt_ids, batch.prompt_mask, ids, mask, chunk_tokens=chunk_tokens
                        )
                        refs[index, column] = logps.sum(dim=-1).float().cpu()
        finally:
            model.train(was_training)
        logger.info(
            "computed reference log-probs of %d of %d pairs with the initial model", len(missing), len(pairs)
        )
        return refs

    def next(self, device: torch.device) -> ReplayBatch:
        """The next `per_step` pairs."""
        return self._batch(self._cycle.take(self._per_step), device)

    def state_dict(self) -> dict[str, int]:
        return self._cycle.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._cycle.load_state_dict(state)

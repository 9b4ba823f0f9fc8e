"""Preference pairs as replay batches: tokenised once, reference log-probabilities fixed once, served in a
resumable shuffled order.

Each completion is scored as its tokens followed by EOS, like a rollout that stopped, so the replay channel
also teaches where an answer ends. DPO needs log pi_ref of both completions. Pairs that carry them
(`chosen_ref_logp`, `rejected_ref_logp`, computed under the same convention) use them as given; for the
others they are computed here, once, with the model the objective is built with, which must be the run's
initial model (TRL's `precompute_ref_log_probs`). That costs one forward pass per pair and no second copy of
the model. Pairs a live harvest adds later are scored by the model they are added with (``extend``).
SimPO needs no reference, and nothing is computed for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from composer_serverless.data.chat import Rendered
from composer_serverless.data.records import Cycle, PreferencePair, Prompt
from composer_serverless.losses.batches import ReplayBatch
from composer_serverless.losses.logprobs import completion_logprobs

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

    The set may grow (a live harvest adds pairs at round boundaries, ``extend``): each extension starts a new
    seeded pass over all the pairs held, so new pairs are drawn within one pass of their arrival. A set with
    no pairs yet gives no batch.

    Args:
        pairs: the shard's pairs (may be empty when a live harvest will bring them).
        tokenizer: the run's tokenizer.
        per_step: pairs per batch.
        seed: order of the passes over the pairs.
        reference: the initial model, to compute missing reference log-probs; None for SimPO (none needed).
        chunk_tokens: LM-head chunk size for that computation.
        render: how a pair's prompt text becomes the model's input (a chat template's user turn, or as it is).
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
        render: Callable[[Prompt], Rendered] = lambda text: Rendered(str(text), templated=False),
    ) -> None:
        self._tokenizer = tokenizer
        self._render = render
        self._pad = tokenizer.pad_token_id
        self._per_step = per_step
        self._seed = seed
        self._chunk_tokens = chunk_tokens
        self._needs_reference = reference is not None
        self._prompts: list[list[int]] = []
        self._chosen: list[list[int]] = []
        self._rejected: list[list[int]] = []
        self._refs: torch.Tensor | None = torch.zeros(0, 2) if self._needs_reference else None
        self._cycle: Cycle | None = None
        self.extend(pairs, reference)

    def __len__(self) -> int:
        return len(self._prompts)

    def extend(
        self,
        pairs: Sequence[PreferencePair],
        reference: nn.Module | None,
        refs: Sequence[Sequence[float]] | None = None,
    ) -> list[list[float]] | None:
        """Add ``pairs`` and start a new pass over every pair held.

        For DPO their reference log-probs are ``refs`` when given (a resumed replica's, as it computed them),
        else the pairs' own, else computed with ``reference``. Returns the (chosen, rejected) reference
        log-probs added, None for SimPO.
        """
        if not pairs:
            return [] if self._needs_reference else None
        eos = self._tokenizer.eos_token_id
        rendered = [self._rendered(p) for p in pairs]
        prompts = [self._tokenizer(r.text, add_special_tokens=not r.templated)["input_ids"] for r in rendered]
        empty = next((p for p, ids in zip(pairs, prompts, strict=True) if not ids), None)
        if empty is not None:
            raise ValueError(f"{empty.source}: the prompt encodes to no tokens")
        start = len(self._prompts)
        self._prompts += prompts
        self._chosen += [
            self._tokenizer(p.chosen, add_special_tokens=False)["input_ids"] + [eos] for p in pairs
        ]
        self._rejected += [
            self._tokenizer(p.rejected, add_special_tokens=False)["input_ids"] + [eos] for p in pairs
        ]
        added = None
        if self._refs is not None:
            if refs is not None:
                new = torch.tensor([list(r) for r in refs], dtype=torch.float32).reshape(-1, 2)
            else:
                assert reference is not None, "DPO pairs need a reference model or given log-probs"
                new = self._reference_logps(pairs, range(start, len(self._prompts)), reference)
            self._refs = torch.cat([self._refs, new])
            added = new.tolist()
        epoch = -1 if self._cycle is None else self._cycle.state_dict()["epoch"]
        self._cycle = Cycle(len(self._prompts), self._seed)
        self._cycle.load_state_dict({"epoch": epoch + 1, "index": 0})
        return added

    def _rendered(self, pair: PreferencePair) -> Rendered:
        """The pair's prompt as the model reads it; a trace's state (a conversation with tools) rendered by
        the chat template with the tools' schemas, as the episode's prompt was, up to the assistant's turn."""
        if not pair.tools:
            return self._render(pair.prompt)
        text = self._tokenizer.apply_chat_template(
            list(pair.prompt), tools=list(pair.tools), tokenize=False, add_generation_prompt=True
        )
        return Rendered(text, templated=True)

    def _batch(self, index: Sequence[int], device: torch.device, *, with_refs: bool = True) -> ReplayBatch:
        prompt_ids, prompt_mask = _left([self._prompts[i] for i in index], self._pad)
        chosen_ids, chosen_mask = _right([self._chosen[i] for i in index], self._pad)
        rejected_ids, rejected_mask = _right([self._rejected[i] for i in index], self._pad)
        refs = None if self._refs is None or not with_refs else self._refs[list(index)].to(device)
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
        self, pairs: Sequence[PreferencePair], rows: range, model: nn.Module
    ) -> torch.Tensor:
        """(N, 2) log pi_ref of (chosen, rejected) of ``pairs`` (held at ``rows``): given values where the pair
        has them, else computed with ``model``."""
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
                    batch = self._batch([rows[i] for i in index], device, with_refs=False)
                    for column, (ids, mask) in enumerate(
                        ((batch.chosen_ids, batch.chosen_mask), (batch.rejected_ids, batch.rejected_mask))
                    ):
                        logps = completion_logprobs(
                            model,
                            batch.prompt_ids,
                            batch.prompt_mask,
                            ids,
                            mask,
                            chunk_tokens=self._chunk_tokens,
                        )
                        refs[index, column] = logps.sum(dim=-1).float().cpu()
        finally:
            model.train(was_training)
        logger.info("computed reference log-probs of %d of %d pairs", len(missing), len(pairs))
        return refs

    def next(self, device: torch.device) -> ReplayBatch | None:
        """The next `per_step` pairs; None while there are none."""
        if self._cycle is None:
            return None
        return self._batch(self._cycle.take(self._per_step), device)

    def state_dict(self) -> dict[str, int]:
        return {} if self._cycle is None else self._cycle.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self._cycle is not None:
            self._cycle.load_state_dict(state)

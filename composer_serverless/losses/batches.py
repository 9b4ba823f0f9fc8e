"""The inputs of the three-channel loss, checked when they are built: the RL part (prompts, sampled
completions, advantages), the SDPO hint part, the replay part, and the batch that holds them.

Padding convention for every part: prompts (contexts) LEFT-padded, completions RIGHT-padded, as `generate` and
vLLM return them with left-padded prompts. Completion token j of every row is then column P + j of
`[prompt, completion]`. A batch that breaks it fails here, naming the field, not as a silently wrong loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def require(condition: bool | torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` holds: how the losses refuse inputs they cannot use."""
    if not bool(condition):
        raise ValueError(message)


def _check_ids(name: str, ids: torch.Tensor) -> None:
    require(ids.dim() == 2, f"{name} must be 2-D (rows, tokens), got shape {tuple(ids.shape)}")
    require(
        not ids.dtype.is_floating_point and ids.dtype != torch.bool, f"{name} must hold integer token ids"
    )


def _check_mask(name: str, mask: torch.Tensor, like: torch.Tensor) -> None:
    require(mask.shape == like.shape, f"{name} shape {tuple(mask.shape)} != ids shape {tuple(like.shape)}")
    require(((mask == 0) | (mask == 1)).all(), f"{name} must hold only 0 and 1")


def _check_left_padded(name: str, mask: torch.Tensor) -> None:
    require(not (mask[:, 1:] < mask[:, :-1]).any(), f"{name} must be left-padded (zeros, then ones)")
    require(mask.size(1) > 0 and mask[:, -1].all(), f"{name}: every row needs at least one prompt token")


def _check_right_padded(name: str, mask: torch.Tensor) -> None:
    require(not (mask[:, 1:] > mask[:, :-1]).any(), f"{name} must be right-padded (ones, then zeros)")


def _check_prompt_completion(
    prefix: str,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    what: str,
) -> None:
    _check_ids(f"{prefix}.prompt_ids", prompt_ids)
    _check_mask(f"{prefix}.prompt_mask", prompt_mask, prompt_ids)
    _check_left_padded(f"{prefix}.prompt_mask", prompt_mask)
    _check_ids(f"{prefix}.{what}_ids", ids)
    _check_mask(f"{prefix}.{what}_mask", mask, ids)
    _check_right_padded(f"{prefix}.{what}_mask", mask)
    require(
        ids.size(0) == prompt_ids.size(0),
        f"{prefix}: {ids.size(0)} {what} rows for {prompt_ids.size(0)} prompts",
    )


@dataclass(frozen=True)
class RLBatch:
    """Completions sampled from the current policy, G per prompt, with their advantages: the GRPO input.

    Row b is `[prompt_ids[b], completion_ids[b]]`; prompts left-padded, completions right-padded.

    Attributes:
        prompt_ids: (B, P) int, left-padded prompts; the G completions of a prompt are G rows.
        prompt_mask: (B, P) 0/1, 1 on prompt tokens; every row has at least one.
        completion_ids: (B, C) int, right-padded sampled completions (with EOS when it was sampled).
        completion_mask: (B, C) 0/1, 1 on completion tokens up to and including EOS, 0 on the padding after.
        advantages: (B,) float, one per completion, e.g. `grpo.group_advantages(rewards, G)`; or (B, C) per token.
        loss_mask: (B, C) 0/1 or None; the completion tokens that enter the GRPO loss, default `completion_mask`.
            Zero out tokens the policy did not sample (tool outputs) or whole truncated completions.
        old_logps: (B, C) float or None; log pi_old of each sampled token at sampling time and temperature
            (`logprobs.completion_logprobs` under no_grad). None means on-policy: the ratio is exactly 1.
        ref_logps: (B, C) float or None; reference-model log-probs, needed when `GRPOSettings.kl_beta > 0`.
        num_items: loss-token count of everything one optimizer step averages over (all micro-batches and ranks),
            the `dapo` normaliser; None means this batch's count.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_items: int | torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_prompt_completion(
            "RLBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            "completion",
        )
        rows, width = self.completion_ids.shape
        require(
            self.advantages.shape in ((rows,), (rows, width)) and self.advantages.dtype.is_floating_point,
            f"RLBatch.advantages must be float (B,) or (B, C), got {tuple(self.advantages.shape)}",
        )
        if self.loss_mask is not None:
            _check_mask("RLBatch.loss_mask", self.loss_mask, self.completion_ids)
            require(
                not (self.loss_mask.bool() & ~self.completion_mask.bool()).any(),
                "RLBatch.loss_mask must be a subset of completion_mask",
            )
        for name in ("old_logps", "ref_logps"):
            value = getattr(self, name)
            require(
                value is None or (value.shape == (rows, width) and value.dtype.is_floating_point),
                f"RLBatch.{name} must be float (B, C) = {(rows, width)}",
            )

    def scored_mask(self) -> torch.Tensor:
        """(B, C) bool, the tokens of the GRPO loss."""
        return (self.completion_mask if self.loss_mask is None else self.loss_mask).bool()


@dataclass(frozen=True)
class HintBatch:
    """The hinted teacher's view of the RL batch's completions: the SDPO input. Row b belongs to RL row b.

    The teacher sequence is the student's sequence with a hint inserted anywhere before the tokens it teaches (in
    the prompt, or inside the completion near a mistake); `teacher_positions` says where each completion token
    landed. Padding of `teacher_ids` is free (positions come from the mask); `from_hinted_prompts` builds the
    common case `[hinted prompt, completion]`.

    Attributes:
        teacher_ids: (B, T) int, the hinted sequences.
        teacher_mask: (B, T) 0/1, 1 on real tokens.
        teacher_positions: (B, C) int, column of completion token j of row b in `teacher_ids`, so that
            `teacher_ids[b, teacher_positions[b, j]] == completion_ids[b, j]` (checked); read only where
            `distill_mask` is 1, must be >= 1 there (the token needs a predecessor).
        distill_mask: (B, C) 0/1, the completion tokens that receive the SDPO loss, a subset of the RL
            `completion_mask`; all zero for rows without a hint (SDPO: samples with neither a solution nor feedback).
        num_items: distilled-token count of everything one optimizer step averages over; None: this batch's.
    """

    teacher_ids: torch.Tensor
    teacher_mask: torch.Tensor
    teacher_positions: torch.Tensor
    distill_mask: torch.Tensor
    num_items: int | torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_ids("HintBatch.teacher_ids", self.teacher_ids)
        _check_mask("HintBatch.teacher_mask", self.teacher_mask, self.teacher_ids)
        _check_ids("HintBatch.teacher_positions", self.teacher_positions)
        _check_mask("HintBatch.distill_mask", self.distill_mask, self.teacher_positions)
        require(
            self.teacher_positions.size(0) == self.teacher_ids.size(0),
            f"HintBatch: {self.teacher_positions.size(0)} position rows for {self.teacher_ids.size(0)} sequences",
        )

    @classmethod
    def from_hinted_prompts(
        cls,
        hinted_prompt_ids: torch.Tensor,
        hinted_prompt_mask: torch.Tensor,
        rl: RLBatch,
        distill_mask: torch.Tensor | None = None,
        num_items: int | torch.Tensor | None = None,
    ) -> HintBatch:
        """Teacher sequences `[hinted prompt, the RL completion]`.

        Args:
            hinted_prompt_ids: (B, Ph) int, left-padded prompts with the hint inserted.
            hinted_prompt_mask: (B, Ph) 0/1.
            rl: the RL batch whose completions the teacher scores.
            distill_mask: (B, C) 0/1 or None for `rl.completion_mask` (distil every completion token).
            num_items: see the class attributes.
        """
        _check_ids("hinted_prompt_ids", hinted_prompt_ids)
        _check_mask("hinted_prompt_mask", hinted_prompt_mask, hinted_prompt_ids)
        _check_left_padded("hinted_prompt_mask", hinted_prompt_mask)
        rows, width = rl.completion_ids.shape
        offset = hinted_prompt_ids.size(1)
        positions = torch.arange(offset, offset + width, device=rl.completion_ids.device).expand(rows, width)
        return cls(
            teacher_ids=torch.cat([hinted_prompt_ids, rl.completion_ids], dim=1),
            teacher_mask=torch.cat([hinted_prompt_mask.long(), rl.completion_mask.long()], dim=1),
            teacher_positions=positions,
            distill_mask=rl.completion_mask if distill_mask is None else distill_mask,
            num_items=num_items,
        )


@dataclass(frozen=True)
class ReplayBatch:
    """Preference pairs from frozen traces, both completions of the same context: the replay input.

    Prompts left-padded, completions right-padded, as in `RLBatch`.

    Attributes:
        prompt_ids: (N, P) int, left-padded shared contexts, one per pair.
        prompt_mask: (N, P) 0/1.
        chosen_ids: (N, Lw) int, right-padded preferred completions (e.g. the teacher's action).
        chosen_mask: (N, Lw) 0/1, 1 on completion tokens; only these are scored.
        rejected_ids: (N, Ll) int, right-padded dispreferred completions (e.g. the student's action).
        rejected_mask: (N, Ll) 0/1.
        ref_chosen_logps: (N,) float or None; log pi_ref(chosen | prompt) summed over the completion tokens at
            temperature 1, i.e. `completion_logprobs(ref_model, prompt_ids, prompt_mask, chosen_ids,
            chosen_mask).sum(-1)` under no_grad. Required for DPO, unused by SimPO.
        ref_rejected_logps: (N,) float or None, the same for the rejected completions.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_prompt_completion(
            "ReplayBatch", self.prompt_ids, self.prompt_mask, self.chosen_ids, self.chosen_mask, "chosen"
        )
        _check_prompt_completion(
            "ReplayBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.rejected_ids,
            self.rejected_mask,
            "rejected",
        )
        pairs = self.prompt_ids.size(0)
        require(
            (self.ref_chosen_logps is None) == (self.ref_rejected_logps is None),
            "ReplayBatch: give both reference tensors or neither",
        )
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            value = getattr(self, name)
            require(value is None or value.shape == (pairs,), f"ReplayBatch.{name} must be ({pairs},)")


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch of the three-channel loss; a missing part switches its channel off.

    Attributes:
        rl: GRPO rollouts; also the student side of SDPO.
        hint: SDPO teacher sequences for the rows of `rl` (needs `rl`).
        replay: preference pairs.
    """

    rl: RLBatch | None = None
    hint: HintBatch | None = None
    replay: ReplayBatch | None = None

    def __post_init__(self) -> None:
        require(self.hint is None or self.rl is not None, "LossBatch.hint needs the rl part it distils")

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


class Checks:
    """Conditions a batch must meet, those on tensors verified together: each ``bool()`` of a device tensor
    makes the host wait for the device, and a batch has about twenty of them. Conditions that are plain
    bools (shapes, dtypes) are checked at once, so no tensor condition is computed on inputs of the wrong
    shape."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, str]] = []

    def require(self, condition: bool | torch.Tensor, message: str) -> None:
        if isinstance(condition, torch.Tensor):
            self._pending.append((condition.reshape(()), message))
        elif not condition:
            raise ValueError(message)

    def verify(self) -> None:
        """Raise ``ValueError`` with the first unmet condition's message (one host synchronisation)."""
        if not self._pending:
            return
        conditions, messages = zip(*self._pending, strict=True)
        self._pending = []
        for met, message in zip(torch.stack(conditions).tolist(), messages, strict=True):
            if not met:
                raise ValueError(message)


def _check_ids(checks: Checks, name: str, ids: torch.Tensor) -> None:
    checks.require(ids.dim() == 2, f"{name} must be 2-D (rows, tokens), got shape {tuple(ids.shape)}")
    checks.require(
        not ids.dtype.is_floating_point and ids.dtype != torch.bool, f"{name} must hold integer token ids"
    )


def _check_mask(checks: Checks, name: str, mask: torch.Tensor, like: torch.Tensor) -> None:
    checks.require(
        mask.shape == like.shape, f"{name} shape {tuple(mask.shape)} != ids shape {tuple(like.shape)}"
    )
    checks.require(((mask == 0) | (mask == 1)).all(), f"{name} must hold only 0 and 1")


def _check_left_padded(checks: Checks, name: str, mask: torch.Tensor) -> None:
    checks.require(~(mask[:, 1:] < mask[:, :-1]).any(), f"{name} must be left-padded (zeros, then ones)")
    checks.require(mask.size(1) > 0, f"{name}: every row needs at least one prompt token")
    checks.require(mask[:, -1].bool().all(), f"{name}: every row needs at least one prompt token")


def _check_right_padded(checks: Checks, name: str, mask: torch.Tensor) -> None:
    checks.require(~(mask[:, 1:] > mask[:, :-1]).any(), f"{name} must be right-padded (ones, then zeros)")


def _check_prompt_completion(
    checks: Checks,
    prefix: str,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    what: str,
) -> None:
    _check_ids(checks, f"{prefix}.prompt_ids", prompt_ids)
    _check_mask(checks, f"{prefix}.prompt_mask", prompt_mask, prompt_ids)
    _check_left_padded(checks, f"{prefix}.prompt_mask", prompt_mask)
    _check_ids(checks, f"{prefix}.{what}_ids", ids)
    _check_mask(checks, f"{prefix}.{what}_mask", mask, ids)
    _check_right_padded(checks, f"{prefix}.{what}_mask", mask)
    checks.require(
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
            the `bnpo` and `dapo` normaliser; None means this batch's count.
        num_sequences: the completions one optimizer step averages over, the `grpo` and `dr_grpo` normaliser;
            None means this batch's.
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
    num_sequences: int | None = None

    def __post_init__(self) -> None:
        checks = Checks()
        _check_prompt_completion(
            checks,
            "RLBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            "completion",
        )
        rows, width = self.completion_ids.shape
        checks.require(
            self.advantages.shape in ((rows,), (rows, width)) and self.advantages.dtype.is_floating_point,
            f"RLBatch.advantages must be float (B,) or (B, C), got {tuple(self.advantages.shape)}",
        )
        if self.loss_mask is not None:
            _check_mask(checks, "RLBatch.loss_mask", self.loss_mask, self.completion_ids)
            checks.require(
                ~(self.loss_mask.bool() & ~self.completion_mask.bool()).any(),
                "RLBatch.loss_mask must be a subset of completion_mask",
            )
        for name in ("old_logps", "ref_logps"):
            value = getattr(self, name)
            checks.require(
                value is None or (value.shape == (rows, width) and value.dtype.is_floating_point),
                f"RLBatch.{name} must be float (B, C) = {(rows, width)}",
            )
        checks.verify()

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
        always: run the teacher pass even when this batch distils no token. The ranks of a sharded replica
            pass through the model together, so one whose rows have no hint passes with the others (and adds
            0) when any of theirs has one.
    """

    teacher_ids: torch.Tensor
    teacher_mask: torch.Tensor
    teacher_positions: torch.Tensor
    distill_mask: torch.Tensor
    num_items: int | torch.Tensor | None = None
    always: bool = False

    def __post_init__(self) -> None:
        checks = Checks()
        _check_ids(checks, "HintBatch.teacher_ids", self.teacher_ids)
        _check_mask(checks, "HintBatch.teacher_mask", self.teacher_mask, self.teacher_ids)
        _check_ids(checks, "HintBatch.teacher_positions", self.teacher_positions)
        _check_mask(checks, "HintBatch.distill_mask", self.distill_mask, self.teacher_positions)
        checks.require(
            self.teacher_positions.size(0) == self.teacher_ids.size(0),
            f"HintBatch: {self.teacher_positions.size(0)} position rows for {self.teacher_ids.size(0)} sequences",
        )
        checks.verify()

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
        checks = Checks()
        _check_ids(checks, "hinted_prompt_ids", hinted_prompt_ids)
        _check_mask(checks, "hinted_prompt_mask", hinted_prompt_mask, hinted_prompt_ids)
        _check_left_padded(checks, "hinted_prompt_mask", hinted_prompt_mask)
        checks.verify()
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
        num_pairs: the pairs one optimizer step averages over (all micro-batches); None means this batch's.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None
    num_pairs: int | None = None

    def __post_init__(self) -> None:
        checks = Checks()
        _check_prompt_completion(
            checks,
            "ReplayBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.chosen_ids,
            self.chosen_mask,
            "chosen",
        )
        _check_prompt_completion(
            checks,
            "ReplayBatch",
            self.prompt_ids,
            self.prompt_mask,
            self.rejected_ids,
            self.rejected_mask,
            "rejected",
        )
        pairs = self.prompt_ids.size(0)
        checks.require(
            (self.ref_chosen_logps is None) == (self.ref_rejected_logps is None),
            "ReplayBatch: give both reference tensors or neither",
        )
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            value = getattr(self, name)
            checks.require(value is None or value.shape == (pairs,), f"ReplayBatch.{name} must be ({pairs},)")
        checks.verify()


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

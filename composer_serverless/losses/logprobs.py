"""Per-token log-probabilities and student/teacher divergences without a batch x sequence x vocabulary tensor.

Every channel needs far less than the logits: GRPO and replay need the log-probability of each sampled token,
SDPO one divergence per token. So we run only the model's backbone (`model.base_model`, the module whose output
is the final normalised hidden state), keep the hidden states of the positions a loss needs, and apply the LM head
(`model.get_output_embeddings()`) to `chunk_tokens` of them at a time. Each chunk runs under activation
checkpointing: autograd keeps only the chunk's hidden states and recomputes its logits during backward, so the
logits alive at any moment are O(chunk_tokens x vocabulary) in forward and in backward. Values and gradients equal
those from the model's full logits.

Layout: a completion is scored as `[prompt, completion]` with the prompt left-padded and the completion
right-padded, so completion token j of every row sits at column `P + j` and is predicted by the hidden state at
column `P + j - 1`. Position ids are `cumsum(attention_mask) - 1`, as `generate` uses, so left padding does not
shift positions.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Per-token divergence between (n, V) student logits and (n, V) teacher logits, returning (n,).
Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Config attributes by which some families rescale their logits after the head, multiplying (HyperCLOVA X) or
# dividing (Granite) by one name; which of the two a model does is read off its own forward (`_probed_scale`).
_LOGIT_SCALING = ("logits_scaling", "output_multiplier", "lm_head_multiplier")
_probed: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LMHead:
    """A causal LM's output projection plus the logit transforms some families apply after it.

    Attributes:
        weight: (V, H) projection weight (tied or not, the live parameter).
        bias: (V,) or None.
        scale: multiplier of the logits (Cohere's `logit_scale`), 1.0 for most models.
        softcap: `softcap * tanh(z / softcap)` (Gemma 2's `final_logit_softcapping`), None for most models.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) hidden states -> (n, V) logits, upcast to float32 (float64 stays float64)."""
        z = F.linear(hidden, self.weight, self.bias)
        if z.dtype in (torch.float16, torch.bfloat16):
            z = z.float()
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def lm_head_of(model: nn.Module) -> LMHead:
    """The LM head of a Hugging Face causal LM, with the logit transforms its config declares."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}.get_output_embeddings() is {type(head).__name__}, not nn.Linear"
        )
    config = model.config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    head_of = LMHead(
        head.weight,
        head.bias,
        1.0 if scale is None else float(scale),
        getattr(config, "final_logit_softcapping", None),
    )
    declared = [
        (n, float(v)) for n in _LOGIT_SCALING if (v := getattr(config, n, None)) not in (None, 1, 1.0)
    ]
    if not declared:
        return head_of
    if model not in _probed:
        _probed[model] = _probed_scale(model, head_of, *declared[0])
    return dataclasses.replace(head_of, scale=head_of.scale * _probed[model])


def _probed_scale(model: nn.Module, head: LMHead, name: str, value: float) -> float:
    """Whether ``model`` multiplies or divides its logits by ``config.<name>``, read off one forward of its own.

    Raises:
        ValueError: neither reproduces the model's logits.
    """
    ids = torch.arange(4, device=head.weight.device).unsqueeze(0) % head.weight.shape[0]
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits[0].float()
        hidden = hidden_states(model, ids, torch.ones_like(ids))[0]
        for scale in (value, 1.0 / value):
            if torch.allclose(
                dataclasses.replace(head, scale=head.scale * scale).logits(hidden),
                expected,
                rtol=1e-3,
                atol=1e-3,
            ):
                return scale
    raise ValueError(
        f"{type(model).__name__} rescales its logits by config.{name} = {value:g} in a way the loss cannot "
        "reproduce (neither multiplying nor dividing by it gives the model's own logits)"
    )


BACKBONE_FORWARD = "backbone_forward"
"""A method of a model sharded with FSDP2 that runs its backbone as a forward pass of the whole model
(``replicas.shards``): the backbone alone would skip the root's hooks, which gather the embeddings and the head
and reduce their gradients."""


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states (B, T, H) of the model's backbone: everything but the LM head.

    Args:
        model: a Hugging Face causal LM (`PreTrainedModel` with a `base_model`).
        input_ids: (B, T) token ids.
        attention_mask: (B, T) 1 on real tokens, 0 on padding.
    """
    backbone = model.base_model
    if backbone is model:
        raise ValueError(f"{type(model).__name__} has no separate backbone (base_model is the model itself)")
    mask = attention_mask.long()
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    run = getattr(model, BACKBONE_FORWARD, backbone)
    out = run(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def completion_hidden_states(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """(B, C, H) hidden states that predict each completion token of `[prompt, completion]`.

    Args:
        prompt_ids: (B, P) left-padded prompts, P >= 1.
        prompt_mask: (B, P) 1 on prompt tokens.
        completion_ids: (B, C) right-padded completions.
        completion_mask: (B, C) 1 on completion tokens.
    """
    if prompt_ids.dim() != 2 or prompt_ids.size(1) < 1:
        raise ValueError(f"prompt_ids must be (B, P) with P >= 1, got {tuple(prompt_ids.shape)}")
    if completion_ids.dim() != 2 or completion_ids.size(0) != prompt_ids.size(0):
        raise ValueError(
            f"completion_ids {tuple(completion_ids.shape)} do not match prompts {tuple(prompt_ids.shape)}"
        )
    p, c = prompt_ids.size(1), completion_ids.size(1)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    return hidden_states(model, ids, mask)[:, p - 1 : p + c - 1]


def _chunk(
    head: LMHead,
    temperature: float,
    divergence: Divergence | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    logits = head.logits(hidden)
    logps = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    if teacher_hidden is None:
        return (logps,)
    # The teacher shares the head's weight; without no_grad its logits would carry gradient into that weight.
    with torch.no_grad():
        teacher_logits = head.logits(teacher_hidden)
    return logps, divergence(logits[rows], teacher_logits)


def token_logprobs_and_divergence(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: LMHead,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 256,
    teacher_hidden: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
    divergence: Divergence | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `targets` and, for a subset of rows, a student/teacher divergence, chunk by chunk.

    The student's logits of a chunk are computed once and serve both outputs.

    Args:
        hidden: (N, H) student hidden states, one row per scored token.
        targets: (N,) token ids whose log-probabilities are wanted.
        head: the LM head.
        temperature: log-probabilities are those of `softmax(logits / temperature)`.
        chunk_tokens: rows per chunk; the extra peak memory is a few (chunk_tokens, V) float32 tensors.
        teacher_hidden: (M, H) teacher hidden states, aligned with `teacher_rows`; never receives gradient.
        teacher_rows: (M,) increasing indices into the N rows: teacher row i is compared with student row
            `teacher_rows[i]`.
        divergence: maps raw (before temperature) student logits (M_chunk, V) and teacher logits (M_chunk, V) to a
            (M_chunk,) per-token divergence.

    Returns:
        (N,) log-probabilities and (M,) divergences (None without a teacher), both float32 or float64.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be (N, H) and targets (N,); got {tuple(hidden.shape)}, {tuple(targets.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    has_teacher = teacher_hidden is not None
    if has_teacher and (
        teacher_rows is None or divergence is None or teacher_rows.shape != teacher_hidden.shape[:1]
    ):
        raise ValueError("a teacher needs teacher_hidden (M, H), teacher_rows (M,) and a divergence")
    if hidden.size(0) == 0:
        # Zero rows still hang off the graph, so a loss built from them can be backpropagated.
        empty = head.logits(hidden).sum(dim=-1)
        return empty, (empty if has_teacher else None)

    n = hidden.size(0)
    starts = list(range(0, n, chunk_tokens))
    if has_teacher:
        edges = torch.tensor([*starts, n], device=teacher_rows.device)
        bounds = torch.searchsorted(teacher_rows, edges).tolist()
    run = partial(_chunk, head, temperature, divergence)
    track = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logps, divergences = [], []
    for i, start in enumerate(starts):
        stop = min(start + chunk_tokens, n)
        args: tuple[torch.Tensor, ...] = (hidden[start:stop], targets[start:stop])
        if has_teacher:
            lo, hi = bounds[i], bounds[i + 1]
            args += (teacher_hidden[lo:hi].detach(), teacher_rows[lo:hi] - start)
        out = checkpoint(run, *args, use_reentrant=False) if track else run(*args)
        logps.append(out[0])
        if has_teacher:
            divergences.append(out[1])
    return torch.cat(logps), (torch.cat(divergences) if has_teacher else None)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 256,
) -> torch.Tensor:
    """Per-token log-probabilities (B, C) of each completion given its prompt; 0 outside `completion_mask`.

    Use it under `torch.no_grad()` for GRPO's `old_logps` / `ref_logps` (at the sampling temperature) and for
    DPO's precomputed reference (`.sum(-1)` at temperature 1). Layout as in the module docstring.
    """
    mask = completion_mask.bool()
    hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    logps, _ = token_logprobs_and_divergence(
        hidden[mask],
        completion_ids[mask],
        lm_head_of(model),
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    return logps.new_zeros(mask.shape).masked_scatter(mask, logps)

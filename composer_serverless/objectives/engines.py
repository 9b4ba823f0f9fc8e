"""Rollout engines: how a batch of prompts becomes completions (``rollout.engine``).

Every engine answers the same request (each prompt's token ids, completed ``repeats`` times) with the same
thing: each row's tokens up to and including its first EOS, or ``max_new_tokens`` of them. Sampling is pure
in every engine, ``softmax(logits / temperature)`` with top-k, top-p and repetition penalties off, because the
GRPO and SDPO log-probabilities are those of that distribution; every engine builds its whole generation config
from a neutral one (``generation_config``), so nothing a checkpoint's ``generation_config.json`` sets (``min_p``,
``suppress_tokens``, ``min_new_tokens``, ...) joins in. The model generates in eval mode without
gradient, under whatever precision context the trainer holds (its bf16 autocast over float32 masters), with
the parameters it has now: no engine keeps a copy of the weights, so each rollout sees the last optimizer step
and the last sync.

- ``reference``: transformers' ``generate`` with a dynamic cache and no compilation. Every prompt is
  repeated and prefilled G times, and finished rows keep computing until the longest ends. Kept as the oracle
  the others are tested against.
- ``static``: ``generate`` with a static KV cache over fixed widths (prompts left-padded to a multiple of
  ``PROMPT_BUCKET``), so the shapes repeat from step to step; on a real CUDA device transformers compiles the
  decoding step and captures it in CUDA graphs, elsewhere it runs eagerly.
- ``paged``: transformers' continuous batching (``generate_batch``): a paged KV cache, one prefill per prompt
  shared by its G completions, finished rows leaving the batch at once. Its cache takes at most
  ``memory_share`` of the free device memory and is freed when the call returns; its attention implementation
  is the model's (``auto_switch_to_flash`` off: the trainer's attention stays what it loaded).

A further engine (vLLM, say) implements ``RolloutEngine`` and is added to ``ENGINES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

from composer_serverless.accelerator.device import captures_graphs

EngineName = Literal["reference", "static", "paged"]

PROMPT_BUCKET = 64
"""The static engine pads prompts to a multiple of this many tokens, so a compiled decoder sees few widths."""


@dataclass(frozen=True)
class Request:
    """What a rollout asks of an engine.

    Attributes:
        prompts: each prompt's token ids, unpadded.
        repeats: completions per prompt; the rows of one prompt are consecutive in the answer.
        max_new_tokens: the most tokens a completion has, its EOS included.
        temperature: sample from ``softmax(logits / temperature)``; None decodes greedily.
        eos_ids: every token that ends a completion.
        pad_id: the tokenizer's padding token.
    """

    prompts: Sequence[Sequence[int]]
    repeats: int
    max_new_tokens: int
    temperature: float | None
    eos_ids: Sequence[int]
    pad_id: int


class RolloutEngine(Protocol):
    """Completes a request with the model's current weights."""

    name: str

    def complete(self, model: nn.Module, request: Request) -> list[list[int]]:
        """``len(prompts) * repeats`` rows, each a completion's tokens up to and including its first EOS."""
        ...


def _cut(row: Sequence[int], eos_ids: Sequence[int], limit: int) -> list[int]:
    """``row`` up to and including its first EOS, at most ``limit`` tokens."""
    ends = set(eos_ids)
    for i, token in enumerate(row[:limit]):
        if token in ends:
            return list(row[: i + 1])
    return list(row[:limit])


def _sampling(temperature: float | None) -> dict[str, Any]:
    """Pure sampling (or greedy decoding): top-k, top-p and the repetition penalty off."""
    if temperature is None:
        return {"do_sample": False, "repetition_penalty": 1.0}
    return {
        "do_sample": True,
        "temperature": temperature,
        "top_k": 0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
    }


def generation_config(request: Request, **settings: Any) -> Any:
    """The whole generation config of a request, every engine's: a neutral ``GenerationConfig`` with the
    request's length, end and pad tokens, pure sampling (``_sampling``) and the engine's ``settings``, and
    nothing else, so no logits processor a checkpoint's ``generation_config.json`` asks for (``min_p``,
    ``typical_p``, ``epsilon_cutoff``, ``no_repeat_ngram_size``, ``suppress_tokens``, ``min_new_tokens``, ...)
    reshapes the distribution GRPO's ratios are computed under."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=request.max_new_tokens,
        eos_token_id=list(request.eos_ids),
        pad_token_id=request.pad_id,
        **_sampling(request.temperature),
        **settings,
    )


@contextlib.contextmanager
def _generating(model: nn.Module) -> Iterator[None]:
    """Eval mode without gradient, and a neutral ``generation_config`` on the model meanwhile: ``generate``
    fills every field the config it is given leaves unset (None) from the model's, and the neutral value of
    several processors (``min_p``, ``suppress_tokens``, ...) is None."""
    from transformers import GenerationConfig

    was_training = model.training
    # Every module that holds a generation config of its own: the model, or the one a wrapper (PEFT's) hands
    # ``generate`` to, whose config is the one merged.
    kept = {m: vars(m)["generation_config"] for m in model.modules() if "generation_config" in vars(m)}
    model.eval()
    for module in kept:
        module.generation_config = GenerationConfig()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        for module, config in kept.items():
            module.generation_config = config


def left_pad(
    prompts: Sequence[Sequence[int]], pad: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) left-padded token ids and mask, P ``width`` or the longest prompt's length."""
    width = max(len(p) for p in prompts) if width is None else width
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@dataclass(frozen=True)
class GenerateEngine:
    """``model.generate`` on the left-padded prompts, each repeated G times.

    ``static`` False, the reference: a dynamic cache and no compilation on every device, whatever the
    checkpoint's generation config asks (a static cache there would make transformers compile itself on a GPU
    only, a path no CPU run takes). True: a static cache at fixed widths, compiled decoding captured in CUDA
    graphs where a real GPU captures them."""

    static: bool

    @property
    def name(self) -> str:
        return "static" if self.static else "reference"

    def complete(self, model: nn.Module, request: Request) -> list[list[int]]:
        device = next(model.parameters()).device
        width = max(len(p) for p in request.prompts)
        if self.static:
            width = -(-width // PROMPT_BUCKET) * PROMPT_BUCKET
        ids, mask = left_pad(request.prompts, request.pad_id, device, width)
        with _generating(model):
            out = model.generate(  # type: ignore[operator]
                input_ids=ids.repeat_interleave(request.repeats, dim=0),
                attention_mask=mask.repeat_interleave(request.repeats, dim=0),
                generation_config=generation_config(
                    request,
                    cache_implementation="static" if self.static else "dynamic",
                    disable_compile=not (self.static and captures_graphs(device)),
                ),
            )
        rows = out[:, width:].tolist()  # one transfer to the host
        return [_cut(row, request.eos_ids, request.max_new_tokens) for row in rows]


@dataclass(frozen=True)
class PagedEngine:
    """Continuous batching with a paged cache (transformers' ``generate_batch``).

    Its seed is drawn from the process's RNG, so a seeded run samples the same rollouts every time; the
    engine reseeds the global RNG for its own sampling, which is confined to this call (``fork_rng``)."""

    memory_share: float = 0.5
    name: str = "paged"

    def complete(self, model: nn.Module, request: Request) -> list[list[int]]:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        device = next(model.parameters()).device
        sampled = request.temperature is not None
        # Greedy decoding returns one sequence per prompt: its repeats are the same prompt asked again.
        prompts = [list(p) for p in request.prompts]
        if not sampled:
            prompts = [p for p in prompts for _ in range(request.repeats)]
        generation = generation_config(request, num_return_sequences=request.repeats if sampled else 1)
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        batching = ContinuousBatchingConfig(
            page_size=PAGE,
            # Sized to the request: every row's whole sequence at once and every prompt prefilled in one pass,
            # so nothing waits or is evicted. Where that exceeds the memory share, the engine sizes its cache
            # to the share and queues the rest.
            num_blocks=_blocks(request, len(prompts) * generation.num_return_sequences),
            max_batch_tokens=min(
                BATCH_TOKENS,
                max(sum(len(p) for p in prompts), len(prompts) * generation.num_return_sequences),
            ),
            max_memory_percent=self.memory_share,
            auto_switch_to_flash=False,
            use_cuda_graph=captures_graphs(device),
            seed=seed,
        )
        if _footprint(model, batching) > self.memory_share * _free_bytes(device):
            batching.num_blocks = None
        devices = [device] if device.type == "cuda" else []
        with _generating(model), torch.random.fork_rng(devices=devices):
            outputs = model.generate_batch(  # type: ignore[operator]
                prompts, generation_config=generation, continuous_batching_config=batching, progress_bar=False
            )
        return [
            _cut(out.generated_tokens, request.eos_ids, request.max_new_tokens)
            for out in _in_request_order(outputs, len(prompts), generation.num_return_sequences)
        ]


PAGE = 64
"""Tokens per page of the paged engine's cache: a row wastes less than a page."""

BATCH_TOKENS = 2048
"""The most tokens the paged engine puts through one forward pass: its attention mask grows as this times the
cache's tokens."""


def _blocks(request: Request, rows: int) -> int:
    """Pages for every row's whole sequence (prompt and completion) at once."""
    longest = max(len(p) for p in request.prompts) + request.max_new_tokens
    return rows * -(-longest // PAGE)


def _footprint(model: nn.Module, batching: Any) -> int:
    """The paged engine's bytes: keys and values of every page in every layer, and an attention mask of the
    batch's tokens by the cache's, in the model's dtype."""
    config = model.config.get_text_config()  # type: ignore[union-attr, operator]
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    tokens = batching.num_blocks * PAGE
    return tokens * itemsize * (config.num_hidden_layers * 2 * heads * head_dim + batching.max_batch_tokens)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def _in_request_order(outputs: dict[str, Any], prompts: int, per_prompt: int) -> list[Any]:
    """``generate_batch``'s answers in prompt order, a prompt's children after it (``req_i``, then
    ``req_i__child#j``); a failed request raises with the engine's own error."""
    ordered = []
    for i in range(prompts):
        ids = [f"req_{i}"] + [f"req_{i}__child#{j}" for j in range(per_prompt - 1)]
        for request_id in ids:
            out = outputs.get(request_id)
            if out is None or out.error is not None:
                why = "no answer" if out is None else out.error
                raise RuntimeError(f"the paged rollout engine failed request {request_id}: {why}")
            ordered.append(out)
    return ordered


def make_engine(
    name: EngineName | Literal["auto"], device: torch.device, memory_share: float
) -> RolloutEngine:
    """The engine ``name`` names; ``auto`` picks per device (see ``auto_engine``)."""
    chosen = auto_engine(device) if name == "auto" else name
    if chosen == "paged":
        return PagedEngine(memory_share)
    return GenerateEngine(static=chosen == "static")


def auto_engine(device: torch.device) -> EngineName:
    """``paged`` on a GPU, ``reference`` on a CPU.

    On a CPU no engine wins everywhere (docs/RESULTS.md, section 14): the static cache measured 1.10x
    (Qwen2.5-0.5B's shape, 32 new tokens) to 1.46x (a tiny model, 128 new tokens) the reference's tokens per
    second, but 0.52x on short rollouts (8 new tokens), where padding prompts to its bucket costs more than it
    saves; continuous batching 0.05x to 0.97x. The short rollouts of a CPU's demos and tests decide. On a GPU
    the choice follows the published anchors, not a measurement of ours: continuous batching shares each
    prompt's prefill, drops finished rows and needs no compilation, which a sharded or autocast model would
    complicate; ``benchmarks/rollout_speed.py --device cuda`` (``make gpu-check``) confirms or changes it."""
    return "paged" if device.type == "cuda" else "reference"


def completion_tensors(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) right-padded completion ids and their mask (1 on a completion's tokens, its EOS included), C
    the longest row's length."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([list(r) + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids.to(device), mask.to(device)


ENGINES: tuple[EngineName, ...] = ("reference", "static", "paged")

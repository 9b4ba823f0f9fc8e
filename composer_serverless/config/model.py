"""The model's schema: a Hub checkpoint as it is published (or the offline tiny model), how it is loaded,
the precision it trains in, and LoRA adapters."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from composer_serverless.config.base import StrictModel

# What a config override may set: plain JSON scalars (a dropout, a flag, a rope factor), never objects.
OverrideValue = bool | int | float | str
ATTN_IMPLEMENTATION = re.compile(r"^[A-Za-z0-9_./:-]{1,128}$")
# TRL's and transformers' short names for the dtypes (``--bf16``, ``mixed_precision = "bf16"``), read as ours.
DTYPE_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(value: Any) -> Any:
    """A dtype as this project names it: ``bf16`` -> ``bfloat16``, ``fp32`` -> ``float32`` (any case).

    Raises:
        ValueError: float16 (``fp16``): without loss scaling its gradients underflow, and bfloat16 takes the
            same memory with float32's range.
    """
    if not isinstance(value, str):
        return value
    name = DTYPE_SPELLINGS.get(value.strip().lower(), value.strip().lower())
    if name == "float16":
        raise ValueError(
            f"{value!r} (float16) is not supported: training in it needs loss scaling; use 'bf16' "
            "(bfloat16: the same memory, float32's range)"
        )
    return name


# A dtype setting: 'float32' or 'bfloat16', also spelt 'fp32' or 'bf16'.
Dtype = Annotated[Literal["float32", "bfloat16"], BeforeValidator(dtype_name)]


class TinyModelConfig(StrictModel):
    """A small Llama-family model and a byte-level BPE tokenizer built offline from the demo corpus."""

    vocab_size: int = Field(
        2048, ge=300, le=65536, description="BPE vocabulary size (256 bytes + merges + specials)"
    )
    hidden_size: int = Field(128, ge=16, description="width of the residual stream")
    intermediate_size: int = Field(384, ge=16, description="width of the MLP")
    num_layers: int = Field(2, ge=1, description="decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (also key/value heads)")
    tokenizer_corpus_mb: float = Field(4.0, gt=0, description="MB of training text the tokenizer is fit on")
    tokenizer: Literal["bpe", "chars"] = Field(
        "bpe",
        description="'bpe': byte-level BPE fit on the demo corpus; 'chars': one token per character of "
        "alphabet, for tasks whose answers are a few characters",
    )
    alphabet: str | None = Field(
        None,
        description="'chars' only: the characters that get a token (others become <|unk|>); default "
        "printable ASCII. A small alphabet gives a fresh model a real chance of sampling a right answer",
    )

    chat_template: Literal["qwen2.5"] | None = Field(
        None,
        description="'chars' only: give the tokenizer a published chat template, 'qwen2.5' (Qwen2.5-Instruct's, "
        "with tool calling: tools in <tools>, calls in <tool_call>, answers in <tool_response>), its "
        "<|im_start|> and <|im_end|> as tokens and <|im_end|> as EOS, as Qwen2.5's tokenizer has; for chat "
        "data and agentic episodes. Unset: no chat template",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        return self

    @model_validator(mode="after")
    def _chars_has_no_fitted_vocabulary(self) -> TinyModelConfig:
        # Compared with the defaults, not with model_fields_set: the resolved run.json spells every field out.
        fitted = [
            name
            for name in ("vocab_size", "tokenizer_corpus_mb")
            if getattr(self, name) != type(self).model_fields[name].default
        ]
        if self.tokenizer == "chars" and fitted:
            raise ValueError(
                "tokenizer = 'chars' takes its vocabulary from alphabet and is not fit on a corpus; "
                f"remove {', '.join(fitted)}"
            )
        if self.chat_template is not None and self.tokenizer != "chars":
            raise ValueError(
                "chat_template is for tokenizer = 'chars' (the BPE tokenizer has no chat tokens); set that or "
                "remove chat_template"
            )
        if self.alphabet is not None:
            if self.tokenizer != "chars":
                raise ValueError("alphabet is the vocabulary of tokenizer = 'chars'; set that or remove it")
            repeated = sorted({c for c in self.alphabet if self.alphabet.count(c) > 1})
            if not self.alphabet or repeated:
                raise ValueError(f"alphabet must be non-empty, each character once (repeated: {repeated})")
        return self


class LoraConfig(StrictModel):
    """LoRA adapters (peft): only they train, travel and are checkpointed; the base weights stay frozen.

    SDPO's teacher and DPO's reference are the base model with the adapters switched off, so no second copy
    of the model is kept.
    """

    r: int = Field(8, ge=1, le=4096, description="rank of each adapter")
    alpha: float = Field(
        16.0, gt=0, description="scaling numerator: the adapter's update is scaled by alpha / r"
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapters' input (0 with the composer objective's SDPO)"
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="'all-linear' (every linear layer but the output head) or module names, e.g. "
        "['q_proj', 'v_proj']",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets: list[str] | str) -> list[str] | str:
        if isinstance(targets, list) and (not targets or not all(targets)):
            raise ValueError("target_modules must name at least one module (or be 'all-linear')")
        return targets


class ModelConfig(StrictModel):
    """Which causal LM to train and how: a Hugging Face hub id or local path, or a tiny model built offline.

    Precision: ``dtype`` is what the forward and backward passes compute in (and what frozen weights are
    stored in); ``master_dtype`` is what trainable weights are kept in, and with them torchft's global copy,
    the outer momentum and the inner optimizer's states. bf16 compute over float32 masters keeps
    fine-tuning-sized updates that bf16 weights would round away.
    """

    path: str | None = Field(None, description="hub id or local directory loadable by from_pretrained")
    tiny: TinyModelConfig | None = Field(None, description="build a tiny model from the demo corpus instead")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) of model.path")
    trust_remote_code: bool = Field(
        False,
        description="run the Python code the checkpoint ships (its config's auto_map); off unless you trust "
        "the repository; shown in the plan",
    )
    attn_implementation: str | None = Field(
        None, description="attention kernel: 'sdpa', 'eager', 'flash_attention_2', ...; unset: the default"
    )
    config_overrides: dict[str, OverrideValue] = Field(
        {},
        description="values set on the model's config before it is built, e.g. {rope_theta = 1e6}; a key the "
        "config lacks is an error",
    )
    dropout: Literal["off", "as_published"] = Field(
        "off",
        description="'off' sets every dropout and LayerDrop probability of the config to 0 (the usual choice "
        "for fine-tuning, and what SDPO needs: its teacher and student pass must be one function); "
        "'as_published' keeps the checkpoint's",
    )
    dtype: Dtype = Field(
        "float32",
        description="compute dtype of the forward and backward passes (and of frozen weights): 'float32' "
        "('fp32') or 'bfloat16' ('bf16')",
    )
    master_dtype: Dtype = Field(
        "float32",
        description="dtype of trainable weights, torchft's global copy, the outer momentum and the inner "
        "optimizer's states; 'bfloat16' halves their memory but rounds away fine-tuning-sized updates",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in backward: less memory, about 30% more time"
    )
    router_aux_loss: float | None = Field(
        None,
        gt=0,
        description="mixture-of-experts models: add this weight times the router's load-balancing loss to "
        "the lm objective's loss",
    )
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of every weight")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a hub id or directory) or [model.tiny]")
        return self

    @model_validator(mode="after")
    def _hub_options_need_a_hub_model(self) -> ModelConfig:
        hub_only = ("revision", "trust_remote_code", "attn_implementation", "config_overrides")
        given = [name for name in hub_only if getattr(self, name) != type(self).model_fields[name].default]
        if self.tiny is not None and given:
            raise ValueError(f"{', '.join(given)} apply to model.path only; the tiny model is built here")
        return self

    @model_validator(mode="after")
    def _masters_at_least_as_wide_as_compute(self) -> ModelConfig:
        if self.master_dtype == "bfloat16" and self.dtype == "float32":
            raise ValueError(
                "master_dtype = 'bfloat16' with dtype = 'float32' would compute in more precision "
                "than the weights hold; set dtype = 'bfloat16' too, or keep float32 masters"
            )
        return self

    @field_validator("attn_implementation")
    @classmethod
    def _attn_name(cls, name: str | None) -> str | None:
        if name is not None and not ATTN_IMPLEMENTATION.match(name):
            raise ValueError(f"{name!r} is not an attention implementation name")
        return name

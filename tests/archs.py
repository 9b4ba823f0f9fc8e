"""Tiny random models of many architecture families, built from their configs and saved as a Hub checkpoint
is published (``save_pretrained``, with a tokenizer), so they load through the same ``from_pretrained`` path a
user's model takes. Sizes are the smallest each family accepts; what matters is the family's code."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

# Shared shape: 2 layers, width 32, 4 heads (2 key/value heads where the family has grouped queries).
_BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2}


def _families() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (config class in transformers, its arguments beyond the vocabulary and special tokens)."""
    return {
        "llama": ("LlamaConfig", {**_BASE, "num_key_value_heads": 2, "tie_word_embeddings": False}),
        "qwen2": ("Qwen2Config", {**_BASE, "num_key_value_heads": 2, "tie_word_embeddings": True}),
        "qwen3": ("Qwen3Config", {**_BASE, "num_key_value_heads": 2, "head_dim": 8}),
        "mistral": ("MistralConfig", {**_BASE, "num_key_value_heads": 2, "tie_word_embeddings": False}),
        "phi3": ("Phi3Config", {**_BASE, "num_key_value_heads": 2, "pad_token_id": None}),
        "gemma2": ("Gemma2Config", {**_BASE, "num_key_value_heads": 2, "head_dim": 8}),
        "gemma3": ("Gemma3TextConfig", {**_BASE, "num_key_value_heads": 2, "head_dim": 8}),
        "gpt_neox": (
            "GPTNeoXConfig",
            {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        ),
        # GPT-2 and OPT with the dropout they are published with (0.1); the run's model.dropout decides.
        "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}),
        "opt": (
            "OPTConfig",
            {
                "hidden_size": 32,
                "ffn_dim": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "word_embed_proj_dim": 32,
                "dropout": 0.1,
                "attention_dropout": 0.1,
                "layerdrop": 0.1,
                "max_position_embeddings": 256,
            },
        ),
        "falcon": ("FalconConfig", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}),
        "bloom": ("BloomConfig", {"hidden_size": 32, "n_layer": 2, "n_head": 4, "hidden_dropout": 0.1}),
        "granite": ("GraniteConfig", {**_BASE, "num_key_value_heads": 2, "logits_scaling": 4.0}),
        "qwen2_moe": (
            "Qwen2MoeConfig",
            {
                **_BASE,
                "num_key_value_heads": 2,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 32,
                **_MOE,
            },
        ),
        "mixtral": (
            "MixtralConfig",
            {**_BASE, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        # Keeps its router in float32 when loaded in bf16 (_keep_in_fp32_modules_strict): mixed dtypes.
        "ernie4_5_moe": (
            "Ernie4_5_MoeConfig",
            {
                **_BASE,
                "num_key_value_heads": 2,
                "moe_intermediate_size": 16,
                "moe_num_experts": 4,
                "moe_k": 2,
            },
        ),
    }


FAMILIES = tuple(_families())


def build(family: str, tokenizer_dir: Path, out: Path, *, seed: int = 0) -> Path:
    """Save a tiny random ``family`` model with the tokenizer of ``tokenizer_dir`` into ``out``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, options = _families()[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), **{**special, **options})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out

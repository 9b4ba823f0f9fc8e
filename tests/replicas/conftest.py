"""Fixtures for the replica-side tests: a tiny Llama with the character tokenizer, and JSONL writers."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from composer_serverless.models.loading import char_tokenizer
from tests.composer_tasks import ALPHABET

# Tiny tensors: one thread avoids two OpenMP threads waiting on each other on a shared 2-core machine.
torch.set_num_threads(1)


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Logits with std ~1, not HF's near-uniform 0.02 init, so samples and greedy decodes vary by row.
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config).train()


@pytest.fixture
def tokenizer():
    return char_tokenizer(ALPHABET)


@pytest.fixture
def model(tokenizer):
    return tiny_model(tokenizer)


@pytest.fixture
def jsonl(tmp_path):
    """write(name, records) -> path; records are dicts (dumped as JSON) or raw strings (written as is)."""

    def write(name: str, records: list) -> str:
        path = tmp_path / name
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
        return str(path)

    return write

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# The oracles import trl.experimental (GKD, CPO); its import-time warning says nothing about our code.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).float()


@pytest.fixture
def model() -> LlamaForCausalLM:
    """A 2-layer random Llama (vocab 64, hidden 32) in training mode; its logits are random but real."""
    return tiny_llama().train()

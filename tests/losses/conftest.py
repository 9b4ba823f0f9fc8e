import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# The oracles import trl.experimental (GKD, CPO); its import-time warning says nothing about our code.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# These tensors are tiny: with two OpenMP threads on a shared 2-core machine every matmul waits for the other
# core (15 ms for an 18 x 32 @ 32 x 64 product, 10 us on one thread).
torch.set_num_threads(1)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # HF's default 0.02 gives near-uniform logits (max prob 0.02) on which every divergence is ~1e-4;
        # 0.2 gives logits with std ~1, so the oracle comparisons test values that are not all near zero.
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).float()


@pytest.fixture
def model() -> LlamaForCausalLM:
    """A 2-layer random Llama (vocab 64, hidden 32) in training mode; its logits are random but real."""
    return tiny_llama().train()

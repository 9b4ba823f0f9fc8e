"""What a replica counts of the tokens it trained on (``replicas/touches.py``): the forward passes that count,
the blocks of a fragment's bucket that are token-indexed, and the state a resume restores."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from composer_serverless.rendezvous.rows import RowBlock
from composer_serverless.replicas.diloco import split_fragments
from composer_serverless.replicas.node import SOLO
from composer_serverless.replicas.touches import Touches

VOCAB, WIDTH = 40, 8


def llama(*, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
        )
    )


def offsets(fragment: torch.nn.Module) -> dict[str, int]:
    """Each parameter's offset in the fragment's flat bucket: its parameters in order, as torchft packs them."""
    out, at = {}, 0
    for name, p in fragment.named_parameters():
        out[name], at = at, at + p.numel()
    return out


def test_an_untied_head_and_the_embedding_are_both_token_rows_of_fragment_0() -> None:
    model = llama(tied=False)
    fragments = split_fragments(model, 2)
    touches = Touches(model, fragments, SOLO)
    at = offsets(fragments[0])
    assert touches.blocks[0] == (
        RowBlock(offset=at["model__embed_tokens__weight"], rows=VOCAB, width=WIDTH),
        RowBlock(offset=at["lm_head__weight"], rows=VOCAB, width=WIDTH),
    )
    assert touches.blocks[1] == ()  # decoder layers only
    assert touches.take(1) is None


def test_a_tied_embedding_is_one_block() -> None:
    model = llama(tied=True)
    touches = Touches(model, split_fragments(model, 1), SOLO)
    assert touches.blocks == [(RowBlock(offset=0, rows=VOCAB, width=WIDTH),)]


def test_only_forwards_that_train_count_and_a_sync_starts_the_next_count() -> None:
    model = llama(tied=True)
    touches = Touches(model, split_fragments(model, 1), SOLO)
    model(input_ids=torch.tensor([[3, 5, 5, 7]]))
    with torch.no_grad():  # generation, evaluation, a reference's scores
        model(input_ids=torch.tensor([[1, 2]]))
    with torch.inference_mode():
        model(input_ids=torch.tensor([[9]]))
    mask = touches.take(0)
    assert mask is not None
    assert mask.touched.nonzero().flatten().tolist() == [3, 5, 7]
    assert not touches.take(0).touched.any()  # the count restarted at the sync


def test_the_count_is_saved_and_restored_and_cleared() -> None:
    model = llama(tied=False)
    touches = Touches(model, split_fragments(model, 1), SOLO)
    model(input_ids=torch.tensor([[0, 39]]))
    saved = touches.state_dict()
    touches.clear()
    assert not touches.state_dict()["0"].any()
    touches.load_state_dict(saved)
    assert touches.take(0).touched.nonzero().flatten().tolist() == [0, 39]
    touches.load_state_dict(None)  # an own state saved without counts (embedding_average = "all")
    assert not touches.state_dict()["0"].any()


def test_a_frozen_embedding_counts_nothing() -> None:
    """LoRA trains adapters only: the embedding is in no fragment, so its rows are not exchanged at all."""
    model = llama(tied=True)
    model.get_input_embeddings().weight.requires_grad_(False)
    touches = Touches(model, split_fragments(model, 1), SOLO)
    assert touches.blocks == [()] and touches.take(0) is None
    model(input_ids=torch.tensor([[1]]))  # no hook was installed

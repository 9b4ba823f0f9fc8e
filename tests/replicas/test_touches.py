"""What a replica counts of the tokens it trained on (``replicas/touches.py``): the forward passes that count,
the blocks of a fragment's bucket that are token-indexed, and the state a resume restores."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from composer_serverless.rendezvous.rows import MAX_BUCKETS, RowBlock
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
    touches = Touches(model, fragments, SOLO, window=1)
    at = offsets(fragments[0])
    assert touches.blocks[0] == (
        RowBlock(offset=at["model__embed_tokens__weight"], rows=VOCAB, width=WIDTH),
        RowBlock(offset=at["lm_head__weight"], rows=VOCAB, width=WIDTH),
    )
    assert touches.blocks[1] == ()  # decoder layers only
    assert touches.take(1) is None


def test_a_tied_embedding_is_one_block() -> None:
    model = llama(tied=True)
    touches = Touches(model, split_fragments(model, 1), SOLO, window=1)
    assert touches.blocks == [(RowBlock(offset=0, rows=VOCAB, width=WIDTH),)]


def test_only_forwards_that_train_count_and_a_sync_starts_the_next_count() -> None:
    model = llama(tied=True)
    touches = Touches(model, split_fragments(model, 1), SOLO, window=1)
    model(input_ids=torch.tensor([[3, 5, 5, 7]]))
    with torch.no_grad():  # generation, evaluation, a reference's scores
        model(input_ids=torch.tensor([[1, 2]]))
    with torch.inference_mode():
        model(input_ids=torch.tensor([[9]]))
    mask = touches.take(0)
    assert mask is not None and mask.touched.shape == (VOCAB, 1)
    assert mask.touched[:, 0].nonzero().flatten().tolist() == [3, 5, 7]
    assert not touches.take(0).touched.any()  # the count restarted at the sync


def test_each_step_of_a_window_marks_its_own_bucket() -> None:
    model = llama(tied=True)
    touches = Touches(model, split_fragments(model, 1), SOLO, window=4)
    for step, tokens in enumerate([[1], [2, 1], [], [3]]):
        if tokens:
            model(input_ids=torch.tensor([tokens]))
        touches.advance()
        assert touches._bucket(0) == min(step + 1, 3)  # past the window's end: its last bucket
    touched = touches.take(0).touched
    assert touched.shape == (VOCAB, 4)
    assert touched[1].tolist() == [True, True, False, False]
    assert touched[2].tolist() == [False, True, False, False]
    assert touched[3].tolist() == [False, False, False, True]
    model(input_ids=torch.tensor([[5]]))  # the next window opened at the sync: its first bucket
    assert touches.take(0).touched[5].tolist() == [True, False, False, False]


def test_a_long_window_has_at_most_max_buckets() -> None:
    model = llama(tied=True)
    touches = Touches(model, split_fragments(model, 1), SOLO, window=500)
    assert touches.buckets == MAX_BUCKETS == 64
    for _ in range(250):  # half the window: bucket 32 of 64
        touches.advance()
    model(input_ids=torch.tensor([[7]]))
    assert touches.take(0).touched[7].nonzero().flatten().tolist() == [32]


def test_the_marks_and_the_window_position_are_saved_and_restored_and_cleared() -> None:
    model = llama(tied=False)
    touches = Touches(model, split_fragments(model, 1), SOLO, window=4)
    model(input_ids=torch.tensor([[0, 39]]))
    touches.advance()
    saved = touches.state_dict()
    touches.clear()
    assert not touches.state_dict()["0"].any() and touches._bucket(0) == 0
    restored = Touches(model, split_fragments(model, 1), SOLO, window=4)  # a restarted replica's
    restored.load_state_dict(saved)
    assert restored._bucket(0) == 1  # one step into its window, as when it was saved
    assert restored.take(0).touched[:, 0].nonzero().flatten().tolist() == [0, 39]
    restored.load_state_dict(None)  # an own state saved without marks (embedding_average = "all")
    assert not restored.state_dict()["0"].any()


def test_a_frozen_embedding_counts_nothing() -> None:
    """LoRA trains adapters only: the embedding is in no fragment, so its rows are not exchanged at all."""
    model = llama(tied=True)
    model.get_input_embeddings().weight.requires_grad_(False)
    touches = Touches(model, split_fragments(model, 1), SOLO, window=1)
    assert touches.blocks == [()] and touches.take(0) is None
    model(input_ids=torch.tensor([[1]]))  # no hook was installed

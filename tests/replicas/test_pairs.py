"""Replay pairs: layout, and the DPO reference fixed once with the initial model."""

import pytest
import torch

from composer_serverless.data.records import PreferencePair
from composer_serverless.losses.logprobs import completion_logprobs
from composer_serverless.objectives.pairs import ReplayPairs

PAIRS = [
    PreferencePair("add 2 3=", "5", "6"),
    PreferencePair("sort 592=", "259", "92", chosen_ref_logp=-3.0, rejected_ref_logp=-4.0),
    PreferencePair("max 1=", "1", "10"),
]


def test_batches_end_completions_with_eos_and_pad_like_the_loss_expects(model, tokenizer):
    pairs = ReplayPairs(PAIRS, tokenizer, per_step=3, seed=0, reference=None, chunk_tokens=16)
    batch = pairs.next(torch.device("cpu"))
    assert batch.ref_chosen_logps is None
    order = [
        tokenizer.decode(row[mask.bool()])
        for row, mask in zip(batch.prompt_ids, batch.prompt_mask, strict=True)
    ]
    assert sorted(order) == sorted(p.prompt for p in PAIRS)
    row = order.index("sort 592=")
    chosen = batch.chosen_ids[row][batch.chosen_mask[row].bool()].tolist()
    assert chosen == tokenizer("259", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert batch.prompt_mask[:, -1].all() and not batch.chosen_mask[:, 0].eq(0).any()


def test_missing_reference_log_probs_are_computed_once_with_the_initial_model_given_ones_kept(
    model, tokenizer
):
    pairs = ReplayPairs(PAIRS, tokenizer, per_step=3, seed=0, reference=model, chunk_tokens=16)
    assert model.training
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training moves the model; the reference must not move with it
    batch = pairs.next(torch.device("cpu"))
    prompts = [
        tokenizer.decode(r[m.bool()]) for r, m in zip(batch.prompt_ids, batch.prompt_mask, strict=True)
    ]
    row = prompts.index("sort 592=")
    assert batch.ref_chosen_logps[row] == -3.0 and batch.ref_rejected_logps[row] == -4.0
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)
    model.eval()
    row = prompts.index("add 2 3=")
    expected = completion_logprobs(
        model,
        batch.prompt_ids[row : row + 1],
        batch.prompt_mask[row : row + 1],
        batch.chosen_ids[row : row + 1],
        batch.chosen_mask[row : row + 1],
    ).sum()
    assert batch.ref_chosen_logps[row] == pytest.approx(expected.item(), abs=1e-5)


def test_the_position_resumes(tokenizer):
    pairs = ReplayPairs(PAIRS, tokenizer, per_step=2, seed=1, reference=None, chunk_tokens=16)
    pairs.next(torch.device("cpu"))
    state = pairs.state_dict()
    ahead = pairs.next(torch.device("cpu")).prompt_ids
    other = ReplayPairs(PAIRS, tokenizer, per_step=2, seed=1, reference=None, chunk_tokens=16)
    other.load_state_dict(state)
    assert torch.equal(other.next(torch.device("cpu")).prompt_ids, ahead)

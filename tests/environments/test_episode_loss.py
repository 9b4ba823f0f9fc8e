"""The loss's view of a real episode, on a tiny Llama on the simulated accelerator: only the model's tokens
carry loss, log-probabilities are over the whole trajectory, and SDPO's hint enters at the error site."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.environments.episodes import Limits, run_episodes
from composer_serverless.environments.tensors import site_hint_batch, trajectory_tensors
from composer_serverless.environments.tools import ToolEnvironment
from composer_serverless.losses import compose
from composer_serverless.losses.batches import LossBatch, RLBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.losses.logprobs import completion_logprobs

LIMITS = Limits(max_turns=4, max_tokens=400, turn_tokens=100, tool_timeout_s=5.0)


def divide(a: int, b: int) -> float:
    """Divide.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def call(**arguments) -> str:
    return "<tool_call>" + json.dumps({"name": "divide", "arguments": arguments}) + "</tool_call>"


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config).train()


@pytest.fixture
def episodes(codec, scripted):
    """Two episodes: one with a failing call (an error site) before its answer, one without."""
    model = scripted({"Q1": [call(a=1, b=0), call(a=4, b=2), "2"], "Q2": [call(a=6, b=3), "2"]})
    envs = [ToolEnvironment([divide]) for _ in range(2)]
    return run_episodes(model, [model.prompt_ids("Q1"), model.prompt_ids("Q2")], envs, codec, LIMITS)


def _student_hidden(monkeypatch):
    """The student's hidden states of the completion, kept with their gradient."""
    kept = []
    original = compose.completion_hidden_states

    def keeping(*args, **kwargs):
        hidden = original(*args, **kwargs)
        hidden.retain_grad()
        kept.append(hidden)
        return hidden

    monkeypatch.setattr(compose, "completion_hidden_states", keeping)
    return kept


def test_only_model_tokens_carry_loss_and_logprobs_are_the_sum_over_them(episodes, tokenizer, monkeypatch):
    kept = _student_hidden(monkeypatch)
    with simulated():
        model = tiny_llama(tokenizer).to("cuda")
        tensors = trajectory_tensors(episodes, tokenizer.pad_token_id, torch.device("cuda"))
        rl = RLBatch(**tensors, advantages=torch.tensor([1.0, -1.0], device="cuda"))
        loss, _ = three_channel_loss(model, LossBatch(rl=rl), LossSettings())
        loss.backward()
        grad = kept[0].grad.norm(dim=-1)  # (B, C): the gradient reaching each trajectory position
        model_tokens = tensors["loss_mask"].bool()
        others = tensors["completion_mask"].bool() & ~model_tokens
        assert others.sum() > 40 and model_tokens.sum() > 40  # tool turns and template tokens in both rows
        assert torch.equal(grad[others], torch.zeros_like(grad[others]))  # exactly 0, not small
        assert (grad[model_tokens] > 0).all()

        with torch.no_grad():
            logps = completion_logprobs(
                model, rl.prompt_ids, rl.prompt_mask, rl.completion_ids, rl.completion_mask
            )
            for row, episode in enumerate(episodes):
                # By hand: the unpadded sequence through the model, log-softmax, each model token's entry.
                sequence = torch.tensor([episode.prompt_ids + episode.ids], device="cuda")
                table = torch.log_softmax(model(input_ids=sequence).logits[0].float(), dim=-1)
                start = len(episode.prompt_ids)
                by_hand = sum(
                    table[start + j - 1, token].item()
                    for j, (token, by_model) in enumerate(zip(episode.ids, episode.model, strict=True))
                    if by_model
                )
                ours = logps[row][model_tokens[row]].sum().item()
                assert ours == pytest.approx(by_hand, abs=1e-4)


def test_the_hint_enters_at_the_error_site_and_sdpo_covers_the_tokens_after_it_only(
    episodes, tokenizer, monkeypatch
):
    failing, clean = episodes
    (site,) = failing.sites
    assert site.kind == "tool_raised" and clean.sites == []
    hint_ids = tokenizer(f" Hint: {site.hint}", add_special_tokens=False)["input_ids"]
    kept = _student_hidden(monkeypatch)
    with simulated():
        model = tiny_llama(tokenizer).to("cuda")
        tensors = trajectory_tensors(episodes, tokenizer.pad_token_id, torch.device("cuda"))
        # Advantages 0: GRPO adds no gradient, so what reaches the student is SDPO's alone.
        rl = RLBatch(**tensors, advantages=torch.zeros(2, device="cuda"))
        hint = site_hint_batch(episodes, [(site.position, hint_ids), None], rl, tokenizer.pad_token_id)
        teacher = hint.teacher_ids[0][hint.teacher_mask[0].bool()].tolist()
        start = len(failing.prompt_ids)
        assert (
            teacher
            == failing.prompt_ids + failing.ids[: site.position] + hint_ids + failing.ids[site.position :]
        )
        assert tokenizer.decode(
            teacher[start + site.position - 13 : start + site.position + len(hint_ids)]
        ) == (f"<|assistant|> Hint: {site.hint}")
        after = torch.zeros_like(tensors["loss_mask"])
        after[0, site.position : len(failing.ids)] = 1
        assert torch.equal(hint.distill_mask, tensors["loss_mask"] * after)
        loss, metrics = three_channel_loss(model, LossBatch(rl=rl, hint=hint), LossSettings(alpha=1.0))
        loss.backward()
        grad = kept[0].grad.norm(dim=-1)
        distilled = hint.distill_mask.bool()
        assert (grad[distilled] > 0).all()
        assert torch.equal(grad[~distilled], torch.zeros_like(grad[~distilled]))
        assert not distilled[0, : site.position].any() and not distilled[1].any()

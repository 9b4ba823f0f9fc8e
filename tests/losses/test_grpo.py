"""GRPO channel: advantages, clipping, k3 KL and TRL 1.16's normalisation per loss_type."""

import contextlib
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from composer_serverless.losses.grpo import (
    GRPOSettings,
    dynamic_sampling_keep,
    group_advantages,
    grpo_loss,
    k3_kl,
)

B, C, V = 6, 7, 11


class _Accelerator:
    """What `GRPOTrainer._compute_loss` asks of accelerate, on one process."""

    num_processes = 1

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return contextlib.nullcontext()


def _trl_loss(settings: GRPOSettings, logits, ids, mask, advantages, old, ref, num_items):
    """TRL 1.16's own `GRPOTrainer._compute_loss`, run unbound on a stand-in `self`.

    The stand-in returns our logits' log-probs where TRL would run the model, and disables every TRL feature we
    do not implement (entropy masking, off-policy masking, vLLM correction, entropy bonus, sequence-level IS).
    """
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1),
            torch.zeros(ids.shape),
            None,
        ),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=settings.kl_beta,
        loss_type=settings.loss_type,
        epsilon_low=settings.eps_low,
        epsilon_high=settings.eps_high,
        use_vllm=False,
        args=SimpleNamespace(
            use_bias_correction_kl=settings.kl_importance_correction, delta=None, steps_per_generation=1
        ),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=settings.max_completion_length,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(ids.size(0), 1, dtype=torch.long),
        "prompt_mask": torch.ones(ids.size(0), 1, dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(num_items),
    }
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def _random_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(B, C, V, generator=g)).requires_grad_()
    ids = torch.randint(0, V, (B, C), generator=g)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    mask[4, 1:] = 0
    current = torch.log_softmax(logits.detach(), -1).gather(-1, ids[..., None]).squeeze(-1)
    # Off-policy enough that both clip sides are hit.
    old = current + 0.4 * torch.randn(B, C, generator=g)
    ref = current + 0.3 * torch.randn(B, C, generator=g)
    advantages = torch.randn(B, generator=g)
    return logits, ids, mask, advantages, old, ref


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(("kl_beta", "correction"), [(0.0, True), (0.04, True), (0.04, False)])
def test_matches_trl_compute_loss(loss_type, kl_beta, correction):
    logits, ids, mask, advantages, old, ref = _random_case()
    settings = GRPOSettings(
        loss_type=loss_type,
        eps_low=0.2,
        eps_high=0.28,
        kl_beta=kl_beta,
        kl_importance_correction=correction,
        max_completion_length=9,
    )
    # For dapo, a global token count larger than this micro-batch's, as with gradient accumulation.
    num_items = int(mask.sum()) + 13

    expected = _trl_loss(settings, logits, ids, mask, advantages, old, ref, num_items)
    (expected_grad,) = torch.autograd.grad(expected, logits)

    logps = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    loss, metrics = grpo_loss(
        logps,
        advantages,
        mask,
        settings,
        old_logps=old,
        ref_logps=ref,
        num_items=num_items if loss_type == "dapo" else None,
    )
    (grad,) = torch.autograd.grad(loss, logits)

    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5)
    assert metrics["grpo/loss"] == loss.detach()
    assert metrics["grpo/clip_ratio/low"] > 0 and metrics["grpo/clip_ratio/high"] > 0


def test_dapo_without_num_items_is_the_local_token_mean():
    logits, ids, mask, advantages, old, _ = _random_case(1)
    logps = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    dapo, _ = grpo_loss(logps, advantages, mask, GRPOSettings(loss_type="dapo"), old_logps=old)
    bnpo, _ = grpo_loss(logps, advantages, mask, GRPOSettings(loss_type="bnpo"), old_logps=old)
    assert torch.equal(dapo, bnpo)


def test_on_policy_loss_and_gradient_by_hand():
    # With old = logps.detach() the ratio is 1, so loss = -sum(A * m) / N and d loss / d logp = -A * m / N.
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([0.5, -1.5])
    loss, _ = grpo_loss(logps, advantages, mask, GRPOSettings(loss_type="bnpo"))
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 * 3 - 1.5 * 2) / 5)
    expected = torch.tensor([[-0.1, -0.1, -0.1], [0.3, 0.3, 0.0]])
    torch.testing.assert_close(logps.grad, expected)


def test_advantages_by_hand():
    # Unbiased std of [1, 0, 1, 0] is sqrt(1/3) = 0.5774; TRL adds 1e-4.
    advantages = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(advantages, torch.tensor([a, -a, a, -a]))


def test_advantages_match_trl_formula():
    # TRL computes advantages inside the 600-line `_generate_and_score_completions`, which cannot run without a
    # model and reward functions; this reproduces its two lines with TRL's own `nanstd`.
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(3))
    grouped = rewards.view(-1, 6)
    centred = rewards - grouped.mean(1).repeat_interleave(6)
    trl_group = centred / (nanstd(grouped, dim=1).repeat_interleave(6) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 6), trl_group, rtol=0, atol=1e-6)
    torch.testing.assert_close(group_advantages(rewards, 6, scale_rewards="none"), centred, rtol=0, atol=1e-7)


def test_equal_rewards_give_exactly_zero_advantage_where_trl_does_not():
    rewards = torch.tensor([0.3] * 6 + [1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    trl_style = (rewards.view(2, 6) - rewards.view(2, 6).mean(1, keepdim=True)) / (
        rewards.view(2, 6).std(1, keepdim=True) + 1e-4
    )
    assert (trl_style[0] != 0).all()  # float32 rounding of the mean leaves a residue of ~3e-4
    for scale in ("group", "none"):
        advantages = group_advantages(rewards, 6, scale_rewards=scale)
        assert torch.equal(advantages[:6], torch.zeros(6))
        assert (advantages[6:] != 0).all()


def test_dynamic_sampling_keeps_groups_with_signal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.25, 0.5])
    keep = dynamic_sampling_keep(rewards, 3)
    assert keep.tolist() == [False, True, False, True]
    # Exactly the groups whose advantages are not all zero.
    assert torch.equal(keep, group_advantages(rewards, 3).view(4, 3).ne(0).any(1))


@pytest.mark.parametrize(
    ("rewards", "group_size"),
    [(torch.ones(5), 2), (torch.ones(4), 1), (torch.ones(2, 2), 2), (torch.tensor([1.0, float("nan")]), 2)],
)
def test_advantage_inputs_are_validated(rewards, group_size):
    with pytest.raises(ValueError):
        group_advantages(rewards, group_size)


@pytest.mark.parametrize(
    ("ratio", "advantage", "value", "grad"),
    [
        (1.3, 1.0, -1.28, 0.0),  # clipped at 1 + eps_high: no gradient
        (0.7, -1.0, 0.8, 0.0),  # clipped at 1 - eps_low: no gradient
        (0.7, 1.0, -0.7, -0.7),  # min picks r * A: unclipped, d(-rA)/dlogp = -rA
        (1.3, -1.0, 1.3, 1.3),  # min picks r * A
        (1.1, 1.0, -1.1, -1.1),  # inside the range
    ],
)
def test_clip_higher_truth_table(ratio, advantage, value, grad):
    old = torch.tensor([[-1.0]])
    logps = (old + math.log(ratio)).requires_grad_()
    settings = GRPOSettings(loss_type="bnpo", eps_low=0.2, eps_high=0.28)
    loss, _ = grpo_loss(logps, torch.tensor([advantage]), torch.ones(1, 1), settings, old_logps=old)
    loss.backward()
    assert loss.item() == pytest.approx(value, abs=1e-6)
    assert logps.grad.item() == pytest.approx(grad, abs=1e-6)


def test_k3_is_non_negative_and_zero_only_at_equality():
    logps = torch.linspace(-5, 0, 101)
    ref = torch.linspace(-4, -0.5, 101).flip(0)
    kl = k3_kl(logps, ref)
    assert (kl >= 0).all()
    assert torch.equal(k3_kl(logps, logps), torch.zeros(101))
    assert (kl[(logps - ref).abs() > 1e-3] > 0).all()


def test_masked_entries_are_ignored_even_when_not_finite():
    logps = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    old = torch.tensor([[-1.1, -1.9, float("-inf")]])
    ref = torch.tensor([[-1.2, -2.1, float("nan")]])
    settings = GRPOSettings(loss_type="grpo", kl_beta=0.1)
    loss, _ = grpo_loss(logps, torch.tensor([1.0]), mask, settings, old_logps=old, ref_logps=ref)
    loss.backward()
    clean, _ = grpo_loss(
        logps[:, :2], torch.tensor([1.0]), mask[:, :2], settings, old_logps=old[:, :2], ref_logps=ref[:, :2]
    )
    assert torch.isfinite(logps.grad).all() and logps.grad[0, 2] == 0
    torch.testing.assert_close(loss, clean)


def test_all_masked_gives_exact_zero_with_graph():
    logps = torch.randn(2, 3, requires_grad=True)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        settings = GRPOSettings(loss_type=loss_type, max_completion_length=3)
        loss, _ = grpo_loss(logps, torch.ones(2), torch.zeros(2, 3), settings)
        (grad,) = torch.autograd.grad(loss, logps)
        assert loss.item() == 0 and torch.equal(grad, torch.zeros(2, 3))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_type": "ppo"},
        {"loss_type": "dr_grpo"},
        {"eps_low": 1.0},
        {"eps_high": -0.1},
        {"kl_beta": -1.0},
        {"temperature": 0.0},
    ],
)
def test_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        GRPOSettings(**kwargs)


def test_call_errors_are_explicit():
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, torch.zeros(2), torch.ones(2, 3), GRPOSettings(kl_beta=0.1))
    with pytest.raises(ValueError, match="num_items"):
        grpo_loss(logps, torch.zeros(2), torch.ones(2, 3), GRPOSettings(loss_type="grpo"), num_items=5)
    with pytest.raises(ValueError, match="num_sequences"):
        grpo_loss(logps, torch.zeros(2), torch.ones(2, 3), GRPOSettings(loss_type="dapo"), num_sequences=4)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logps, torch.zeros(3), torch.ones(2, 3), GRPOSettings())

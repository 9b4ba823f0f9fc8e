"""Replay channel: DPO against TRL 1.16's DPOTrainer, SimPO against its CPOTrainer, and hand values."""

import copy
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.utils import add_fused_lm_head

from composer_serverless.losses.batches import LossBatch, ReplayBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.losses.replay import ReplaySettings, dpo_loss, replay_loss, simpo_loss


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x


def _trl_dpo(model, batch: ReplayBatch, beta: float) -> torch.Tensor:
    """TRL 1.16's own `DPOTrainer._compute_loss` (sigmoid, precomputed reference), run on a stand-in `self`.

    TRL scores `[prompt, completion]` rows, chosen rows first, through its fused LM head, which must be patched
    onto the model first. Prompts here have no padding, so TRL's right-padded layout is ours too.
    """
    width = max(batch.chosen_ids.size(1), batch.rejected_ids.size(1))

    def pad(x):
        return torch.nn.functional.pad(x, (0, width - x.size(1)))

    completions = torch.cat([pad(batch.chosen_ids), pad(batch.rejected_ids)])
    completion_mask = torch.cat([pad(batch.chosen_mask), pad(batch.rejected_mask)])
    prompts = torch.cat([batch.prompt_ids, batch.prompt_ids])
    inputs = {
        "input_ids": torch.cat([prompts, completions], dim=1),
        "attention_mask": torch.cat([torch.ones_like(prompts), completion_mask], dim=1),
        "completion_mask": torch.cat([torch.zeros_like(prompts), completion_mask], dim=1),
        "ref_chosen_logps": batch.ref_chosen_logps,
        "ref_rejected_logps": batch.ref_rejected_logps,
    }
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        label_smoothing=0.0,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    return DPOTrainer._compute_loss(trainer, model, inputs, False)


def _pairs(vocab: int, seed: int = 0) -> ReplayBatch:
    g = torch.Generator().manual_seed(seed)
    pairs, prompt, chosen, rejected = 3, 5, 4, 6
    chosen_mask = torch.ones(pairs, chosen, dtype=torch.long)
    chosen_mask[1, 2:] = 0
    rejected_mask = torch.ones(pairs, rejected, dtype=torch.long)
    rejected_mask[0, 3:] = 0
    rejected_mask[2, 5:] = 0
    return ReplayBatch(
        prompt_ids=torch.randint(0, vocab, (pairs, prompt), generator=g),
        prompt_mask=torch.ones(pairs, prompt, dtype=torch.long),
        chosen_ids=torch.randint(0, vocab, (pairs, chosen), generator=g),
        chosen_mask=chosen_mask,
        rejected_ids=torch.randint(0, vocab, (pairs, rejected), generator=g),
        rejected_mask=rejected_mask,
        ref_chosen_logps=-15 + 3 * torch.randn(pairs, generator=g),
        ref_rejected_logps=-20 + 3 * torch.randn(pairs, generator=g),
    )


def test_dpo_matches_trl_dpo_trainer_loss_and_gradients(model):
    batch = _pairs(model.config.vocab_size)
    reference = copy.deepcopy(model)
    add_fused_lm_head(reference, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    expected = _trl_dpo(reference, batch, beta=0.1)
    expected.backward()

    loss, metrics = three_channel_loss(
        model,
        LossBatch(replay=batch),
        LossSettings(beta=1.0, replay=ReplaySettings(dpo_beta=0.1), chunk_tokens=4),
    )
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert set(metrics) >= {"replay/loss", "replay/reward_margin", "replay/reward_accuracy", "loss/total"}


@pytest.mark.parametrize(("beta", "gamma"), [(2.0, 0.5), (2.5, 1.4), (10.0, 0.0)])
def test_simpo_matches_trl_cpo_trainer_loss_and_gradient(beta, gamma):
    g = torch.Generator().manual_seed(1)
    pairs, length, vocab = 3, 8, 13
    logits = (2 * torch.randn(2 * pairs, length, vocab, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (2 * pairs, length), generator=g)
    labels[:, :3] = -100  # prompt
    labels[1, 6:] = -100  # padding after a short chosen completion
    labels[4, 5:] = -100  # and a short rejected one

    trl_logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    cpo = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=0.0,
        accelerator=_Accelerator(),
    )
    losses, _, _ = CPOTrainer.cpo_loss(cpo, trl_logps[:pairs], trl_logps[pairs:])
    expected = losses.mean()  # CPOTrainer.get_batch_loss_metrics with cpo_alpha = 0
    (expected_grad,) = torch.autograd.grad(expected, logits)

    targets = labels[:, 1:]
    mask = targets != -100
    per_token = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    loss, metrics = simpo_loss(
        per_token[:pairs], mask[:pairs], per_token[pairs:], mask[pairs:], beta=beta, gamma=gamma
    )
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5)
    assert metrics["replay/pairs"] == pairs


def _tokens(seed=0, pairs=4, length=5):
    g = torch.Generator().manual_seed(seed)
    chosen = -torch.rand(pairs, length, generator=g) * 3
    rejected = -torch.rand(pairs, length + 2, generator=g) * 3
    chosen_mask = torch.ones(pairs, length, dtype=torch.long)
    chosen_mask[0, 3:] = 0
    rejected_mask = torch.ones(pairs, length + 2, dtype=torch.long)
    rejected_mask[2, 1:] = 0
    return chosen, chosen_mask, rejected, rejected_mask


def test_dpo_at_the_reference_is_exactly_log_2():
    chosen, chosen_mask, rejected, rejected_mask = _tokens()
    ref_chosen = (chosen * chosen_mask).sum(1)
    ref_rejected = (rejected * rejected_mask).sum(1)
    loss, metrics = dpo_loss(chosen, chosen_mask, rejected, rejected_mask, ref_chosen, ref_rejected, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["replay/reward_margin"].abs() < 1e-6


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen, chosen_mask, rejected, rejected_mask = (t.clone() for t in _tokens())
    chosen.requires_grad_()
    rejected.requires_grad_()
    ref_chosen = (chosen * chosen_mask).sum(1).detach()
    ref_rejected = (rejected * rejected_mask).sum(1).detach()
    loss, _ = dpo_loss(chosen, chosen_mask, rejected, rejected_mask, ref_chosen, ref_rejected, beta=0.1)
    loss.backward()
    # At pi = pi_ref, d loss / d logp(chosen token) = -sigmoid(0) * beta / pairs on completion tokens, 0 elsewhere.
    torch.testing.assert_close(chosen.grad, -0.5 * 0.1 / 4 * chosen_mask.float())
    torch.testing.assert_close(rejected.grad, 0.5 * 0.1 / 4 * rejected_mask.float())


def test_only_completion_tokens_are_summed():
    chosen, chosen_mask, rejected, rejected_mask = _tokens()
    refs = torch.zeros(4), torch.zeros(4)
    noisy_chosen = torch.where(chosen_mask.bool(), chosen, torch.full_like(chosen, float("nan")))
    noisy_rejected = torch.where(rejected_mask.bool(), rejected, -1e4)
    for loss_fn in (
        lambda c, r: dpo_loss(c, chosen_mask, r, rejected_mask, *refs, beta=0.1)[0],
        lambda c, r: simpo_loss(c, chosen_mask, r, rejected_mask, beta=2.0, gamma=0.5)[0],
    ):
        assert torch.equal(loss_fn(chosen, rejected), loss_fn(noisy_chosen, noisy_rejected))


def test_simpo_by_hand_and_with_an_empty_completion():
    chosen = torch.tensor([[-1.0, -3.0]])
    rejected = torch.tensor([[-2.0, -2.0, -5.0]])
    loss, _ = simpo_loss(chosen, torch.ones(1, 2), rejected, torch.ones(1, 3), beta=2.0, gamma=0.5)
    margin = 2.0 * (-2.0) - 2.0 * (-3.0) - 0.5
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-margin))))
    empty, _ = simpo_loss(chosen, torch.zeros(1, 2), rejected, torch.ones(1, 3), beta=2.0, gamma=0.5)
    assert torch.isfinite(empty) and empty.item() == pytest.approx(
        -math.log(1 / (1 + math.exp(-(6.0 - 0.5))))
    )


def test_replay_loss_dispatches_and_dpo_needs_references():
    chosen, chosen_mask, rejected, rejected_mask = _tokens()
    simpo = ReplaySettings(kind="simpo", simpo_beta=3.0, simpo_gamma=1.0)
    assert torch.equal(
        replay_loss(chosen, chosen_mask, rejected, rejected_mask, simpo)[0],
        simpo_loss(chosen, chosen_mask, rejected, rejected_mask, beta=3.0, gamma=1.0)[0],
    )
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        replay_loss(chosen, chosen_mask, rejected, rejected_mask, ReplaySettings(kind="dpo"))


@pytest.mark.parametrize("kwargs", [{"kind": "ipo"}, {"dpo_beta": 0.0}, {"simpo_beta": -1.0}])
def test_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        ReplaySettings(**kwargs)


def test_shapes_are_validated():
    chosen, chosen_mask, rejected, rejected_mask = _tokens()
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(chosen, chosen_mask, rejected, rejected_mask, torch.zeros(3), torch.zeros(4), beta=0.1)
    with pytest.raises(ValueError, match="chosen"):
        simpo_loss(chosen, chosen_mask[:, :2], rejected, rejected_mask, beta=2.0, gamma=0.5)

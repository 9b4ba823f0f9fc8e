"""The three-channel loss on a real tiny Llama: passes run, bit-exactness, gradients, and the batch contract."""

import copy
import dataclasses

import pytest
import torch

from composer_serverless.losses.batches import HintBatch, LossBatch, ReplayBatch, RLBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.losses.grpo import GRPOSettings, group_advantages, grpo_loss
from composer_serverless.losses.logprobs import completion_logprobs, hidden_states
from composer_serverless.losses.replay import ReplaySettings, dpo_loss
from composer_serverless.losses.sdpo import SDPOSettings, sdpo_loss, token_divergence

VOCAB = 64
GROUP = 2


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _right_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def _prompts(g):
    # Two prompts, each repeated for its GROUP completions.
    return [p for p in (_tokens(g, 5), _tokens(g, 3)) for _ in range(GROUP)]


def _rl(model, rewards=(1.0, 0.0, 0.5, 0.25), seed=0) -> RLBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_ids, prompt_mask = _left_pad(_prompts(g))
    completion_ids, completion_mask = _right_pad([_tokens(g, n) for n in (6, 4, 5, 2)])
    loss_mask = completion_mask.clone()
    loss_mask[2, 1] = 0  # e.g. a tool-output token inside the completion
    with torch.no_grad():
        current = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return RLBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=group_advantages(torch.tensor(rewards), GROUP),
        loss_mask=loss_mask,
        old_logps=current + 0.3 * torch.randn(completion_ids.shape, generator=g),
        ref_logps=current + 0.3 * torch.randn(completion_ids.shape, generator=g),
    )


def _hint(rl: RLBatch, seed=1, hint_length=3) -> HintBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(rl.prompt_ids, rl.prompt_mask, strict=True)]
    hinted_ids, hinted_mask = _left_pad([p + _tokens(g, hint_length) for p in prompts])
    distill = rl.completion_mask.clone()
    distill[0, :2] = 0  # distil only part of a completion
    distill[3] = 0  # and not at all on a row without a hint
    return HintBatch.from_hinted_prompts(hinted_ids, hinted_mask, rl, distill_mask=distill)


def _replay(seed=2) -> ReplayBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_ids, prompt_mask = _left_pad([_tokens(g, 4), _tokens(g, 2)])
    chosen_ids, chosen_mask = _right_pad([_tokens(g, 3), _tokens(g, 1)])
    rejected_ids, rejected_mask = _right_pad([_tokens(g, 2), _tokens(g, 4)])
    return ReplayBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        chosen_ids=chosen_ids,
        chosen_mask=chosen_mask,
        rejected_ids=rejected_ids,
        rejected_mask=rejected_mask,
        ref_chosen_logps=torch.tensor([-11.0, -4.5]),
        ref_rejected_logps=torch.tensor([-8.0, -16.0]),
    )


SETTINGS = LossSettings(
    alpha=0.7,
    beta=0.3,
    grpo=GRPOSettings(loss_type="dapo", eps_low=0.2, eps_high=0.28, kl_beta=0.04),
    sdpo=SDPOSettings(beta=0.5, temperature=0.9, top_k=9, token_clip=0.08),
    replay=ReplaySettings(kind="dpo", dpo_beta=0.1),
    chunk_tokens=3,
)


def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits


def _naive(model, batch: LossBatch, settings: LossSettings) -> torch.Tensor:
    """The same loss from the model's full (B, T, V) logits, with the teacher on a frozen copy of the model."""
    rl, hint, replay = batch.rl, batch.hint, batch.replay
    p = rl.prompt_ids.size(1)
    student = _logits(
        model,
        torch.cat([rl.prompt_ids, rl.completion_ids], 1),
        torch.cat([rl.prompt_mask, rl.completion_mask], 1),
    )[:, p - 1 : -1]
    logps = torch.log_softmax(student / settings.grpo.temperature, -1)
    logps = logps.gather(-1, rl.completion_ids[..., None]).squeeze(-1)
    total, _ = grpo_loss(
        logps, rl.advantages, rl.scored_mask(), settings.grpo, old_logps=rl.old_logps, ref_logps=rl.ref_logps
    )

    frozen = copy.deepcopy(model).requires_grad_(False)
    teacher = _logits(frozen, hint.teacher_ids, hint.teacher_mask)
    rows = torch.arange(teacher.size(0))[:, None]
    teacher = teacher[rows, (hint.teacher_positions - 1).clamp(min=0)]
    divergence = token_divergence(student, teacher, settings.sdpo)
    total = total + settings.alpha * sdpo_loss(divergence, hint.distill_mask, settings.sdpo)[0]

    sides = []
    for ids, mask in ((replay.chosen_ids, replay.chosen_mask), (replay.rejected_ids, replay.rejected_mask)):
        q = replay.prompt_ids.size(1)
        logits = _logits(
            model, torch.cat([replay.prompt_ids, ids], 1), torch.cat([replay.prompt_mask, mask], 1)
        )
        sides += [torch.log_softmax(logits[:, q - 1 : -1], -1).gather(-1, ids[..., None]).squeeze(-1), mask]
    dpo, _ = dpo_loss(
        *sides, replay.ref_chosen_logps, replay.ref_rejected_logps, beta=settings.replay.dpo_beta
    )
    return total + settings.beta * dpo


def _grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 1e-4, "atol": 1e-5}), (torch.float64, {"rtol": 1e-10, "atol": 1e-12})],
)
def test_all_channels_equal_the_full_logits_path(model, dtype, tol):
    model.to(dtype)
    rl = _rl(model)
    rl = dataclasses.replace(
        rl,
        advantages=rl.advantages.to(dtype),
        old_logps=rl.old_logps.to(dtype),
        ref_logps=rl.ref_logps.to(dtype),
    )
    replay = _replay()
    replay = dataclasses.replace(
        replay,
        ref_chosen_logps=replay.ref_chosen_logps.to(dtype),
        ref_rejected_logps=replay.ref_rejected_logps.to(dtype),
    )
    batch = LossBatch(rl=rl, hint=_hint(rl), replay=replay)
    expected = _naive(model, batch, SETTINGS)
    expected_grads = _grads(model, expected)

    loss, metrics = three_channel_loss(model, batch, SETTINGS)
    grads = _grads(model, loss)
    torch.testing.assert_close(loss, expected, **tol)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **tol)
    assert metrics["sdpo/clipped_fraction"] > 0 and metrics["grpo/clip_ratio/region"] > 0


def _count_passes(model):
    """Record (rows, grad enabled) for every backbone forward."""
    calls = []
    model.base_model.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(
            (kwargs["input_ids"].size(0), torch.is_grad_enabled())
        ),
        with_kwargs=True,
    )
    return calls


@pytest.mark.parametrize(
    ("alpha", "beta", "parts", "passes"),
    [
        (0.0, 0.0, "rl", [(4, True)]),
        (0.0, 0.0, "rl+hint+replay", [(4, True)]),
        (0.5, 0.0, "rl+hint+replay", [(4, False), (4, True)]),
        (0.0, 0.5, "rl+hint+replay", [(4, True), (4, True)]),
        (0.5, 0.5, "rl+hint+replay", [(4, False), (4, True), (4, True)]),
        (0.5, 0.5, "rl", [(4, True)]),
        (0.5, 0.5, "replay", [(4, True)]),
        (0.5, 0.5, "", []),
    ],
)
def test_only_the_passes_the_active_channels_need_are_run(model, alpha, beta, parts, passes):
    rl = _rl(model)
    batch = LossBatch(
        rl=rl if "rl" in parts else None,
        hint=_hint(rl) if "hint" in parts else None,
        replay=_replay() if "replay" in parts else None,
    )
    calls = _count_passes(model)
    loss, metrics = three_channel_loss(model, batch, dataclasses.replace(SETTINGS, alpha=alpha, beta=beta))
    # The teacher pass runs without autograd; chosen and rejected share one pass of 2 x 2 rows.
    assert calls == passes
    loss.backward()
    channels = {key.split("/")[0] for key in metrics}
    assert channels == {"loss"} | {
        name
        for name, on in (
            ("grpo", "rl" in parts),
            ("sdpo", alpha and "hint" in parts),
            ("replay", beta and "replay" in parts),
        )
        if on
    }
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_a_hint_without_distilled_tokens_costs_no_teacher_pass(model):
    rl = _rl(model)
    hint = dataclasses.replace(_hint(rl), distill_mask=torch.zeros_like(rl.completion_mask))
    calls = _count_passes(model)
    _, metrics = three_channel_loss(model, LossBatch(rl=rl, hint=hint), SETTINGS)
    assert calls == [(4, True)] and not any(k.startswith("sdpo/") for k in metrics)


def test_no_active_channel_is_a_differentiable_exact_zero(model):
    calls = _count_passes(model)
    loss, metrics = three_channel_loss(model, LossBatch(), SETTINGS)
    loss.backward()
    assert calls == [] and loss.item() == 0 and metrics == {"loss/total": loss.detach()}
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_zero_weights_reproduce_pure_grpo_bit_exactly(model):
    rl = dataclasses.replace(_rl(model), loss_mask=None)  # score what completion_logprobs scores
    full = LossBatch(rl=rl, hint=_hint(rl), replay=_replay())
    off = dataclasses.replace(SETTINGS, alpha=0.0, beta=0.0)

    loss, _ = three_channel_loss(model, full, off)
    grads = _grads(model, loss)

    alone, _ = three_channel_loss(model, LossBatch(rl=rl), LossSettings(grpo=SETTINGS.grpo, chunk_tokens=3))
    alone_grads = _grads(model, alone)

    logps = completion_logprobs(
        model, rl.prompt_ids, rl.prompt_mask, rl.completion_ids, rl.completion_mask, chunk_tokens=3
    )
    direct, _ = grpo_loss(
        logps,
        rl.advantages,
        rl.completion_mask,
        SETTINGS.grpo,
        old_logps=rl.old_logps,
        ref_logps=rl.ref_logps,
    )
    direct_grads = _grads(model, direct)

    assert torch.equal(loss, alone) and torch.equal(loss, direct)
    for g, a, d in zip(grads, alone_grads, direct_grads, strict=True):
        assert torch.equal(g, a) and torch.equal(g, d)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("rewards", [(1.0, 1.0, 0.0, 0.0), (0.3, 0.3, 0.7, 0.7)])
def test_equal_rewards_in_every_group_give_exactly_zero_gradient(model, loss_type, rewards):
    rl = _rl(model, rewards=rewards)  # off-policy old_logps: the ratios are not 1
    settings = LossSettings(grpo=GRPOSettings(loss_type=loss_type, max_completion_length=8))
    loss, _ = three_channel_loss(model, LossBatch(rl=rl), settings)
    loss.backward()
    assert loss.item() == 0
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, torch.zeros_like(p)), name


def test_no_gradient_reaches_the_teacher_pass(model):
    # GRPO contributes an exact zero here (equal rewards), so every gradient comes from SDPO's student side.
    rl = _rl(model, rewards=(1.0, 1.0, 0.0, 0.0))
    hint = _hint(rl)
    settings = LossSettings(alpha=1.0, sdpo=SDPOSettings(beta=0.0), chunk_tokens=4)
    loss, _ = three_channel_loss(model, LossBatch(rl=rl, hint=hint), settings)
    grads = _grads(model, loss)

    frozen = copy.deepcopy(model).requires_grad_(False)
    p = rl.prompt_ids.size(1)
    student = _logits(
        model,
        torch.cat([rl.prompt_ids, rl.completion_ids], 1),
        torch.cat([rl.prompt_mask, rl.completion_mask], 1),
    )[:, p - 1 : -1]
    teacher = _logits(frozen, hint.teacher_ids, hint.teacher_mask)[:, -rl.completion_ids.size(1) - 1 : -1]
    expected, _ = sdpo_loss(
        token_divergence(student, teacher, settings.sdpo), hint.distill_mask, settings.sdpo
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, _grads(model, expected), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_hint_changes_the_teacher(model):
    rl = _rl(model)
    hint = _hint(rl)
    settings = dataclasses.replace(SETTINGS, beta=0.0)
    _, hinted = three_channel_loss(model, LossBatch(rl=rl, hint=hint), settings)
    no_hint = HintBatch.from_hinted_prompts(rl.prompt_ids, rl.prompt_mask, rl, distill_mask=hint.distill_mask)
    _, plain = three_channel_loss(model, LossBatch(rl=rl, hint=no_hint), settings)
    assert hinted["sdpo/divergence_mean"] > 1e-3
    assert plain["sdpo/divergence_mean"] < 1e-6

    with torch.no_grad():
        student = hidden_states(model, no_hint.teacher_ids, no_hint.teacher_mask)
        teacher = hidden_states(model, hint.teacher_ids, hint.teacher_mask)
    logits = model.get_output_embeddings()
    width = rl.completion_ids.size(1)
    assert (logits(teacher[:, -width - 1 : -1]) - logits(student[:, -width - 1 : -1])).abs().amax() > 1e-2


def test_dropout_must_be_off_for_the_teacher_pass(model):
    rl = _rl(model)
    batch = LossBatch(rl=rl, hint=_hint(rl))
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        three_channel_loss(model, batch, SETTINGS)
    three_channel_loss(model, LossBatch(rl=rl), SETTINGS)  # no teacher pass, no constraint
    model.eval()
    three_channel_loss(model, batch, SETTINGS)


def test_dpo_replay_needs_reference_logps(model):
    replay = dataclasses.replace(_replay(), ref_chosen_logps=None, ref_rejected_logps=None)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        three_channel_loss(model, LossBatch(replay=replay), SETTINGS)
    simpo = dataclasses.replace(SETTINGS, replay=ReplaySettings(kind="simpo"))
    loss, _ = three_channel_loss(model, LossBatch(replay=replay), simpo)
    assert torch.isfinite(loss)


def _rl_fields(model):
    rl = _rl(model)
    return {f.name: getattr(rl, f.name) for f in dataclasses.fields(rl)}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: {"prompt_mask": f["prompt_mask"].flip(1)}, "left-padded"),
        (lambda f: {"completion_mask": f["completion_mask"].flip(1)}, "right-padded"),
        (lambda f: {"prompt_mask": torch.zeros_like(f["prompt_mask"])}, "at least one prompt token"),
        (lambda f: {"prompt_ids": f["prompt_ids"].float()}, "integer token ids"),
        (lambda f: {"completion_mask": f["completion_mask"] * 2}, "only 0 and 1"),
        (lambda f: {"advantages": f["advantages"][:3]}, "advantages"),
        (lambda f: {"loss_mask": torch.ones_like(f["completion_mask"])}, "subset of completion_mask"),
        (lambda f: {"old_logps": f["old_logps"][:, :2]}, "old_logps"),
        (
            lambda f: {
                "completion_ids": f["completion_ids"][:3],
                "completion_mask": f["completion_mask"][:3],
            },
            "rows",
        ),
    ],
)
def test_rl_batch_rejects_malformed_tensors(model, change, message):
    fields = _rl_fields(model)
    with pytest.raises(ValueError, match=message):
        RLBatch(**{**fields, **change(fields)})


def test_misaligned_hint_is_rejected(model):
    rl = _rl(model)
    hint = _hint(rl)
    shifted = dataclasses.replace(hint, teacher_positions=hint.teacher_positions - 1)
    with pytest.raises(ValueError, match="do not point at the completion tokens"):
        three_channel_loss(model, LossBatch(rl=rl, hint=shifted), SETTINGS)
    beyond = dataclasses.replace(hint, distill_mask=torch.ones_like(rl.completion_mask))
    with pytest.raises(ValueError, match="within completion_mask"):
        three_channel_loss(model, LossBatch(rl=rl, hint=beyond), SETTINGS)
    with pytest.raises(ValueError, match="needs the rl part"):
        LossBatch(hint=hint)


def test_settings_are_validated():
    with pytest.raises(ValueError):
        LossSettings(alpha=-1.0)
    with pytest.raises(ValueError):
        LossSettings(chunk_tokens=0)


def test_bfloat16_model_gives_float32_losses_close_to_float32(model):
    rl = _rl(model)
    batch = LossBatch(rl=rl, hint=_hint(rl), replay=_replay())
    reference, _ = three_channel_loss(model, batch, SETTINGS)
    model.to(torch.bfloat16)
    loss, metrics = three_channel_loss(model, batch, SETTINGS)
    loss.backward()
    assert loss.dtype == torch.float32 and all(v.dtype == torch.float32 for v in metrics.values())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(loss, reference, rtol=0.05, atol=0.02)

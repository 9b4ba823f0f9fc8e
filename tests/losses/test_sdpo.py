"""SDPO channel: generalized JSD against TRL 1.16's GKD, hand values, and the two upstream defects fixed."""

import math

import pytest
import torch
from trl.experimental.gkd.gkd_trainer import GKDTrainer

from composer_serverless.losses.sdpo import SDPOSettings, generalized_jsd, sdpo_loss, token_divergence

B, L, V = 3, 7, 11


def _case(dtype=torch.float32, seed=0):
    """The research note's fixture (losses.md section 1.3): ragged -100 labels, logits of scale 2."""
    torch.manual_seed(seed)
    student = torch.randn(B, L, V, dtype=dtype) * 2
    teacher = torch.randn(B, L, V, dtype=dtype) * 2
    labels = torch.randint(0, V, (B, L))
    labels[0, :2] = -100
    labels[2, 5:] = -100
    return student, teacher, labels


def _ours(student, teacher, labels, settings):
    return sdpo_loss(token_divergence(student, teacher, settings), labels != -100, settings)[0]


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_matches_trl_gkd_loss_and_gradient(beta, temperature):
    student, teacher, labels = _case()
    student.requires_grad_()
    expected = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
    (expected_grad,) = torch.autograd.grad(expected, student)
    loss = _ours(student, teacher, labels, SDPOSettings(beta=beta, temperature=temperature))
    (grad,) = torch.autograd.grad(loss, student)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("beta", "temperature", "value"),
    [(0.0, 1.0, 2.7404554301), (0.5, 1.0, 0.4213324614), (1.0, 1.0, 2.8198338811), (0.5, 0.7, 0.5192216484)],
)
def test_pinned_float64_values_from_the_research_note(beta, temperature, value):
    student, teacher, labels = _case(torch.float64)
    loss = _ours(student, teacher, labels, SDPOSettings(beta=beta, temperature=temperature))
    assert loss.item() == pytest.approx(value, abs=1e-9)


def test_endpoints_by_hand():
    s_logits, t_logits = [0.0, 1.0, 2.0], [2.0, 0.0, 0.0]

    def softmax(z):
        e = [math.exp(x) for x in z]
        return [x / sum(e) for x in e]

    def kl(p, q):
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))

    s, t = softmax(s_logits), softmax(t_logits)
    m = [0.3 * ti + 0.7 * si for si, ti in zip(s, t, strict=True)]
    kl_ts, kl_st, jsd = kl(t, s), kl(s, t), 0.3 * kl(t, m) + 0.7 * kl(s, m)
    student, teacher = (
        torch.tensor([s_logits], dtype=torch.float64),
        torch.tensor([t_logits], dtype=torch.float64),
    )
    for beta, value in [(0.0, kl_ts), (1.0, kl_st), (0.3, jsd)]:
        assert token_divergence(student, teacher, SDPOSettings(beta=beta)).item() == pytest.approx(
            value, abs=1e-12
        )


def test_symmetric_jsd_is_bounded_symmetric_and_zero_only_at_equality():
    student, teacher, _ = _case(torch.float64)
    half = SDPOSettings(beta=0.5)
    d = token_divergence(student, teacher, half)
    assert (d > 0).all() and (d <= math.log(2)).all()
    torch.testing.assert_close(d, token_divergence(teacher, student, half), rtol=0, atol=1e-12)
    assert token_divergence(student, student, half).abs().max() < 1e-12


def test_temperature_is_a_rescaling_of_both_logits():
    student, teacher, _ = _case()
    for beta in (0.0, 0.5, 1.0):
        scaled = token_divergence(student, teacher, SDPOSettings(beta=beta, temperature=0.7))
        unscaled = token_divergence(student / 0.7, teacher / 0.7, SDPOSettings(beta=beta))
        torch.testing.assert_close(scaled, unscaled, rtol=0, atol=1e-6)


def test_masked_tokens_change_neither_loss_nor_gradient():
    student, teacher, labels = _case()
    mask = labels != -100
    noisy = student + 5 * torch.randn(B, L, V) * (~mask)[..., None]
    losses, grads = [], []
    for s in (student.clone().requires_grad_(), noisy.clone().requires_grad_()):
        loss = _ours(s, teacher, labels, SDPOSettings(beta=0.5))
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, s)[0])
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0][~mask], torch.zeros_like(grads[0][~mask]))


def test_fully_masked_batch_is_an_exact_zero_that_keeps_the_graph():
    student, teacher, _ = _case()
    student.requires_grad_()
    labels = torch.full((B, L), -100)
    # Upstream defect D1 (OPSD): `jsd[mask].sum() / mask.sum()` is 0 / 0.
    upstream = token_divergence(student, teacher, SDPOSettings())[labels != -100]
    assert torch.isnan(upstream.sum() / (labels != -100).sum())

    loss = _ours(student, teacher, labels, SDPOSettings())
    assert loss.requires_grad and loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_token_clip_never_makes_a_token_loss_negative():
    student, teacher, labels = _case()
    clip = 0.05  # OPSD's default, paired upstream with beta = 0
    mask = labels != -100
    # Upstream defect (OPSD `token_clip`): clamp each vocabulary term of KL(T || S), then sum. Terms where
    # S(v) > T(v) are negative, so the per-token "loss" goes negative.
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    upstream = (log_t.exp() * (log_t - log_s)).clamp(max=clip).sum(-1)
    assert (upstream[mask] < 0).any()

    settings = SDPOSettings(beta=0.0, token_clip=clip)
    divergence = token_divergence(student, teacher, settings)
    loss, _ = sdpo_loss(divergence, mask, settings)
    assert (divergence >= 0).all()
    torch.testing.assert_close(loss, divergence.clamp(max=clip)[mask].mean())


def test_token_clip_stops_the_gradient_of_tokens_above_the_cap_only():
    student, teacher, labels = _case()
    student.requires_grad_()
    mask = labels != -100
    clip = 2.0
    divergence = token_divergence(student, teacher, SDPOSettings(beta=0.0))
    over = mask & (divergence > clip)
    assert over.any() and (mask & ~over).any()
    loss, metrics = sdpo_loss(divergence, mask, SDPOSettings(beta=0.0, token_clip=clip))
    unclipped, _ = sdpo_loss(divergence, mask, SDPOSettings(beta=0.0))
    assert metrics["sdpo/clipped_fraction"] == over.sum() / mask.sum()
    (grad,) = torch.autograd.grad(loss, student, retain_graph=True)
    (unclipped_grad,) = torch.autograd.grad(unclipped, student)
    assert torch.equal(grad[over], torch.zeros_like(grad[over]))
    torch.testing.assert_close(grad[mask & ~over], unclipped_grad[mask & ~over])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_at_vocabulary_size_equals_the_full_divergence(beta):
    student, teacher, _ = _case()
    full = token_divergence(student, teacher, SDPOSettings(beta=beta))
    for k in (V, V + 5):
        torch.testing.assert_close(
            token_divergence(student, teacher, SDPOSettings(beta=beta, top_k=k)), full, rtol=0, atol=1e-6
        )
    # k = V - 1 leaves a one-token tail bucket: exactly the full divergence, computed through the tail.
    torch.testing.assert_close(
        token_divergence(student, teacher, SDPOSettings(beta=beta, top_k=V - 1)), full, rtol=0, atol=1e-5
    )


def test_top_k_tail_is_accurate_when_the_teacher_tail_is_tiny():
    # Reverse KL weighs the student's tail mass by log(S_tail / T_tail); forming T_tail as 1 - sum(top-k) in
    # float32 loses T_tail's digits once it drops near float32's resolution of 1.
    teacher = torch.tensor([[12.0, 11.0, 0.0, -1.0]])
    student = torch.tensor([[1.0, 1.0, 2.0, 2.0]])
    settings = SDPOSettings(beta=1.0, top_k=2)
    exact = token_divergence(student.double(), teacher.double(), settings)
    torch.testing.assert_close(
        token_divergence(student, teacher, settings).double(), exact, rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_top_k_with_tail_is_between_zero_and_the_full_divergence(beta):
    student, teacher, _ = _case(torch.float64)
    full = token_divergence(student, teacher, SDPOSettings(beta=beta))
    top = token_divergence(student, teacher, SDPOSettings(beta=beta, top_k=3))
    assert (top >= 0).all() and (top <= full + 1e-12).all()


def test_top_k_tail_sees_student_mass_outside_the_teacher_top_k():
    # Same proportions as the teacher on the teacher's top 2, but 90% of the student's mass elsewhere.
    teacher = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    student = torch.log(torch.tensor([[0.6 / 9 * 1, 0.3 / 9 * 1, 0.45, 0.45]]))
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    renormalised = generalized_jsd(log_s[:, :2].log_softmax(-1), log_t[:, :2].log_softmax(-1), 0.5)
    assert renormalised.abs().item() < 1e-6  # what a renormalised top-k (no tail) would report
    assert token_divergence(student, teacher, SDPOSettings(beta=0.5, top_k=2)).item() > 0.1


def test_no_gradient_reaches_the_teacher():
    student, teacher, labels = _case()
    student.requires_grad_()
    teacher.requires_grad_()
    for top_k in (None, 4):
        loss = _ours(student, teacher, labels, SDPOSettings(beta=0.5, top_k=top_k))
        loss.backward()
        assert teacher.grad is None
        assert student.grad is not None and student.grad.abs().sum() > 0


def test_num_items_replaces_the_local_token_count():
    student, teacher, labels = _case()
    settings = SDPOSettings()
    divergence = token_divergence(student, teacher, settings)
    mask = labels != -100
    local, _ = sdpo_loss(divergence, mask, settings)
    global_, _ = sdpo_loss(divergence, mask, settings, num_items=4 * int(mask.sum()))
    torch.testing.assert_close(global_, local / 4)


@pytest.mark.parametrize(
    "kwargs", [{"beta": -0.1}, {"beta": 1.5}, {"temperature": 0.0}, {"top_k": 0}, {"token_clip": 0.0}]
)
def test_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        SDPOSettings(**kwargs)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ"):
        token_divergence(torch.zeros(2, 5), torch.zeros(2, 6), SDPOSettings())

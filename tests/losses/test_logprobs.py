"""Chunked LM-head log-probs and divergences equal the full-logits path, and never keep (N, V) for backward."""

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
)

from composer_serverless.losses.logprobs import (
    LMHead,
    completion_hidden_states,
    completion_logprobs,
    hidden_states,
    lm_head_of,
    token_logprobs_and_divergence,
)
from composer_serverless.losses.sdpo import SDPOSettings, token_divergence


def _inputs(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows, prompt, completion = 3, 5, 6
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :4] = 0
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    completion_mask[1, 3:] = 0
    prompt_ids = torch.randint(0, vocab, (rows, prompt), generator=g) * prompt_mask
    completion_ids = torch.randint(0, vocab, (rows, completion), generator=g) * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The naive path: the model's own forward, full (B, T, V) logits, sliced to the completion predictions."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    return logits[:, prompt_ids.size(1) - 1 : -1]


def _naive_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    logits = _full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    logps = torch.log_softmax(logits / temperature, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    return logps * completion_mask


def _param_grads(model, loss):
    return torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)


# float32 shows the chunked path is as accurate as the full one; float64 removes summation-order noise, so a
# tolerance near machine precision shows the two compute the same function.
TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_logprobs_equal_full_logits(model, chunk_tokens, temperature, dtype):
    model.to(dtype)
    tol = TOLERANCE[dtype]
    inputs = _inputs(model.config.vocab_size)
    weights = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    expected = _naive_logprobs(model, *inputs, temperature=temperature)
    expected_grads = _param_grads(model, (expected * weights).sum())
    logps = completion_logprobs(model, *inputs, temperature=temperature, chunk_tokens=chunk_tokens)
    grads = _param_grads(model, (logps * weights).sum())
    torch.testing.assert_close(logps, expected, **tol)
    assert not logps[inputs[3] == 0].any()
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **tol)


@pytest.mark.parametrize("chunk_tokens", [2, 5, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_divergence_equals_full_logits(model, chunk_tokens, dtype):
    model.to(dtype)
    tol = TOLERANCE[dtype]
    vocab = model.config.vocab_size
    prompt_ids, prompt_mask, completion_ids, completion_mask = _inputs(vocab)
    hint = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(9))
    teacher_prompt, teacher_prompt_mask = (
        torch.cat([hint, prompt_ids], 1),
        torch.cat([torch.ones_like(hint), prompt_mask], 1),
    )
    settings = SDPOSettings(beta=0.5, temperature=0.8, top_k=7)
    scored = completion_mask.bool()
    distill = scored.clone()
    distill[0, :2] = False  # a subset of the scored tokens, so the row alignment is exercised

    with torch.no_grad():
        teacher_logits = _full_logits(
            model, teacher_prompt, teacher_prompt_mask, completion_ids, completion_mask
        )
    student_logits = _full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    expected = token_divergence(student_logits[distill], teacher_logits[distill], settings)
    expected_grads = _param_grads(model, expected.sum())

    hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    with torch.no_grad():
        teacher_hidden = completion_hidden_states(
            model, teacher_prompt, teacher_prompt_mask, completion_ids, completion_mask
        )
    _, divergence = token_logprobs_and_divergence(
        hidden[scored],
        completion_ids[scored],
        lm_head_of(model),
        chunk_tokens=chunk_tokens,
        teacher_hidden=teacher_hidden[distill],
        teacher_rows=(scored.flatten().cumsum(0) - 1)[distill.flatten()],
        divergence=lambda s, t: token_divergence(s, t, settings),
    )
    grads = _param_grads(model, divergence.sum())
    torch.testing.assert_close(divergence, expected, **tol)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **tol)


def test_autograd_keeps_no_vocabulary_sized_tensor():
    torch.manual_seed(0)
    vocab, width, rows, chunk = 64, 32, 40, 8
    head = LMHead(torch.nn.Parameter(torch.randn(vocab, width)))
    hidden = torch.randn(rows, width, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))

    def saved_logit_rows(fn):
        rows_saved = [0]

        def pack(x):
            if x.dim() == 2 and x.size(-1) == vocab:
                rows_saved[0] += x.size(0)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        return rows_saved[0]

    naive = saved_logit_rows(lambda: torch.log_softmax(head.logits(hidden), -1).gather(-1, targets[:, None]))
    chunked = saved_logit_rows(
        lambda: token_logprobs_and_divergence(hidden, targets, head, chunk_tokens=chunk)
    )
    assert naive >= rows
    assert chunked == 0


def test_left_padding_does_not_change_a_rows_logprobs(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask = _inputs(model.config.vocab_size)
    with torch.no_grad():
        batched = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        alone = completion_logprobs(
            model, prompt_ids[2:, 4:], prompt_mask[2:, 4:], completion_ids[2:], completion_mask[2:]
        )
    torch.testing.assert_close(batched[2:], alone, rtol=0, atol=1e-5)


def test_empty_selection_stays_on_the_graph(model):
    hidden = completion_hidden_states(model, *_inputs(model.config.vocab_size))
    logps, _ = token_logprobs_and_divergence(
        hidden[:0, 0], torch.zeros(0, dtype=torch.long), lm_head_of(model)
    )
    assert logps.shape == (0,) and logps.requires_grad
    grads = _param_grads(model, logps.sum())
    assert all(g is None or not g.any() for g in grads)


def _tiny(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **extra,
    )
    return model_cls(config).float()


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "extra"),
    [
        (Gemma2Config, Gemma2ForCausalLM, {"final_logit_softcapping": 3.0}),
        (CohereConfig, CohereForCausalLM, {"logit_scale": 0.5}),
    ],
)
def test_logit_softcap_and_scale_families_equal_full_logits(config_cls, model_cls, extra):
    model = _tiny(config_cls, model_cls, **extra)
    head = lm_head_of(model)
    assert head.softcap == extra.get("final_logit_softcapping") and head.scale == extra.get(
        "logit_scale", 1.0
    )
    inputs = _inputs(64)
    with torch.no_grad():
        torch.testing.assert_close(
            completion_logprobs(model, *inputs, chunk_tokens=4),
            _naive_logprobs(model, *inputs),
            rtol=0,
            atol=1e-5,
        )


def test_granite_logits_scaling_is_read_off_the_model_and_equals_full_logits():
    """Granite divides its logits by config.logits_scaling; the head reproduces that, checked against the
    model's own forward."""
    model = _tiny(GraniteConfig, GraniteForCausalLM, logits_scaling=4.0)
    assert lm_head_of(model).scale == 0.25
    inputs = _inputs(64)
    with torch.no_grad():
        torch.testing.assert_close(
            completion_logprobs(model, *inputs, chunk_tokens=4),
            _naive_logprobs(model, *inputs),
            rtol=0,
            atol=1e-5,
        )


def test_hidden_states_needs_a_backbone():
    class Bare(torch.nn.Module):
        base_model = property(lambda self: self)

    with pytest.raises(ValueError, match="backbone"):
        hidden_states(Bare(), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))

"""The rollout engines held to the reference (``generate``, dynamic cache): the same greedy tokens, on the CPU
and on the simulated accelerator, and samples from exactly ``softmax(logits / temperature)``."""

import math
from collections import Counter

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.objectives.engines import (
    ENGINES,
    PROMPT_BUCKET,
    GenerateEngine,
    PagedEngine,
    Request,
    completion_tensors,
    make_engine,
)
from composer_serverless.objectives.rollout import REFERENCE, generate, prompt_token_ids
from tests.replicas.test_rollout import PROMPTS

FAST = [name for name in ENGINES if name != "reference"]


def _engine(name: str):
    return make_engine(name, torch.device("cpu"), memory_share=0.5)


def test_a_completion_ends_at_its_first_eos_even_when_pad_is_eos():
    eos = 7
    rows = [[3, 4, 7], [7], [1, 2, 3, 4, 5]]
    ids, mask = completion_tensors(rows, pad_id=eos, device=torch.device("cpu"))
    assert ids.tolist() == [[3, 4, 7, 7, 7], [7, 7, 7, 7, 7], [1, 2, 3, 4, 5]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_auto_picks_paged_on_an_accelerator_and_the_reference_on_a_cpu():
    assert make_engine("auto", torch.device("cuda"), 0.5) == PagedEngine(0.5)
    assert make_engine("auto", torch.device("cpu"), 0.5) == GenerateEngine(static=False)


@pytest.mark.parametrize("name", FAST)
def test_greedy_tokens_equal_the_references(model, tokenizer, name):
    """Prompts of different lengths, each asked twice (the paged engine asks a greedy prompt again; the static
    one pads every prompt to a bucket): every row's tokens are the reference's."""
    encoded = prompt_token_ids(tokenizer, PROMPTS)
    assert max(map(len, encoded)) < PROMPT_BUCKET, "the static engine pads these prompts"
    request = Request(encoded, 2, 12, None, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    reference = REFERENCE.complete(model, request)
    assert len({tuple(r) for r in reference}) > 2, "a degenerate model would make this comparison vacuous"
    assert _engine(name).complete(model, request) == reference
    assert model.training, "the engine puts the model back in training mode"


@pytest.mark.parametrize("name", FAST)
def test_an_engine_samples_from_the_weights_of_the_last_step(model, tokenizer, name):
    """Weights changed in place (an optimizer step, a sync's copy) between two rollouts: the second one is the
    reference's on the new weights, not a cached copy's."""
    engine = _engine(name)
    request = Request(
        prompt_token_ids(tokenizer, PROMPTS), 1, 8, None, [tokenizer.eos_token_id], tokenizer.pad_token_id
    )
    before = engine.complete(model, request)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    after = engine.complete(model, request)
    assert after == REFERENCE.complete(model, request) and after != before


@pytest.mark.parametrize("name", ["auto", "static"])
def test_a_fast_engine_on_the_simulated_accelerator_gives_the_cpus_tokens(model, tokenizer, name):
    """``auto`` on a GPU is the paged engine: its CUDA path (device memory sized from ``mem_get_info``, its
    own stream, no CUDA graphs where none can be captured) gives the CPU's tokens, on the device; so does the
    static cache's."""
    on_cpu = generate(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=None)
    with simulated():
        model.to("cuda")
        engine = make_engine(name, torch.device("cuda"), 0.5)
        on_device = generate(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=None, engine=engine)
        assert on_device.completion_ids.device.type == "cuda"
    assert on_device.texts == on_cpu.texts
    assert torch.equal(on_device.truncated.cpu(), on_cpu.truncated)


# The distribution test: a model small enough that every two-token completion's exact probability is known.
VOCAB, EOS, PROMPT, DRAWS = 10, 9, [1, 2, 3], 1000


def _small_model() -> LlamaForCausalLM:
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=1,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config).eval()


def _exact(model: LlamaForCausalLM, temperature: float) -> dict[tuple[int, ...], float]:
    """P(completion) under ``softmax(logits / temperature)`` for every completion of at most two tokens."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1] / temperature, -1)
        seconds = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = torch.softmax(model(seconds).logits[:, -1] / temperature, -1)
    out = {(EOS,): float(first[EOS])}
    for t in range(VOCAB):
        if t != EOS:
            out.update({(t, u): float(first[t] * second[t, u]) for u in range(VOCAB)})
    return out


def _chi_square(counts: Counter, exact: dict[tuple[int, ...], float], draws: int) -> tuple[float, float]:
    """Pearson's statistic (cells expected below 5 times pooled into one) and its 0.1 % critical value
    (Wilson-Hilferty's approximation of the chi-square quantile)."""
    cells, pooled_expected, pooled_seen = [], 0.0, 0
    for outcome, p in exact.items():
        if p * draws >= 5:
            cells.append((counts[outcome], p * draws))
        else:
            pooled_expected, pooled_seen = pooled_expected + p * draws, pooled_seen + counts[outcome]
    cells.append((pooled_seen, pooled_expected))
    assert sum(counts.values()) == draws and set(counts) <= set(exact)
    statistic = sum((seen - expected) ** 2 / expected for seen, expected in cells)
    dof = len(cells) - 1
    z = 3.09  # the standard normal's 99.9 % quantile
    return statistic, dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _leaky() -> GenerationConfig:
    """A checkpoint's ``generation_config.json`` that asks for every processor that reshapes or cuts the
    distribution: none of it may reach a rollout."""
    return GenerationConfig(
        min_p=0.3,
        typical_p=0.5,
        epsilon_cutoff=0.05,
        eta_cutoff=0.05,
        top_k=2,
        top_p=0.5,
        temperature=3.0,
        repetition_penalty=2.0,
        no_repeat_ngram_size=1,
        suppress_tokens=[4, 5],
        begin_suppress_tokens=[6],
        min_new_tokens=4,
        bad_words_ids=[[7]],
    )


def _greedy_by_hand(model: LlamaForCausalLM, steps: int) -> list[int]:
    """The argmax of the logits, token by token, over the whole sequence each time (no cache, no config)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == EOS:
                break
    return ids[len(PROMPT) :]


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("name", ENGINES)
def test_a_checkpoints_generation_config_reaches_no_engine(name, lora):
    """With a checkpoint's generation config that suppresses tokens, forbids repeats, delays EOS, cuts by
    min-p and more: every engine's greedy tokens are the argmax by hand (and so each other's), also through
    PEFT's wrapper (whose ``generate`` hands on to the wrapped model, whose config is the one merged), and
    the model keeps its generation config afterwards."""
    from peft import LoraConfig, get_peft_model

    base = _small_model()
    base.generation_config = _leaky()
    expected = _greedy_by_hand(base, 6)
    # The config would bite: the argmax repeats a token or picks one it suppresses.
    assert len(expected) > len(set(expected)) or {4, 5, 6, 7} & set(expected), expected
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])) if lora else base
    request = Request([PROMPT], 2, 6, None, [EOS], 0)
    assert _engine(name).complete(model, request) == [expected, expected]
    assert base.generation_config.min_p == 0.3


@pytest.mark.parametrize("leaky", [False, True], ids=["plain", "leaky-checkpoint"])
@pytest.mark.parametrize("name", ENGINES)
def test_seeded_samples_follow_softmax_of_logits_over_temperature(name, leaky):
    """Each engine's samples of every two-token completion against their exact probabilities at the
    temperature asked: accepted there, and rejected against the distribution of another temperature (the
    test can tell them apart). Seeded, so the outcome is the same on every run. With a checkpoint whose
    generation config asks for min-p, typical-p, suppressed tokens and the like, the same."""
    model = _small_model()
    if leaky:
        model.generation_config = _leaky()
    torch.manual_seed(0)
    request = Request([PROMPT], DRAWS, 2, 0.7, [EOS], 0)
    counts = Counter(tuple(row) for row in _engine(name).complete(model, request))
    statistic, critical = _chi_square(counts, _exact(model, 0.7), DRAWS)
    assert statistic < critical, (name, statistic, critical)
    wrong, critical = _chi_square(counts, _exact(model, 1.0), DRAWS)
    assert wrong > critical, (name, wrong, critical)

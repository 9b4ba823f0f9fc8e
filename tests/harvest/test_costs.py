"""The cost bound and the cap: hand-computed worst cases, the bound held against real tokenizers rendering
real chat templates, and the budget's reserve/settle rules."""

from __future__ import annotations

import asyncio
import random
from fractions import Fraction

import pytest

from composer_serverless.config import HarvestConfig, TeacherConfig
from composer_serverless.harvest.costs import Budget, Price, input_token_bound, worst_case
from composer_serverless.harvest.harvester import messages, request_body
from tests.conftest import CHATML

TEACHER = TeacherConfig(
    name="t",
    base_url="https://api.example.com/v1",
    model="m",
    usd_per_m_input=2.5,
    usd_per_m_output=10.0,
    max_tokens=100,
    extra_input_tokens=7,
)

# Llama 3's template as its tokenizer_config.json ships it (ChatML, Qwen's and many others', from conftest).
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def test_worst_case_by_hand():
    body = b'{"messages":[{"content":"hi","role":"user"}],"model":"m"}'
    assert input_token_bound(body, 7) == len(body) + 7
    expected = Fraction(len(body) + 7) * Fraction(5, 2) / 10**6 + 100 * Fraction(10) / 10**6
    assert worst_case(body, TEACHER) == expected
    assert Price.of(TEACHER).cost(1000, 10) == Fraction(2500 + 100, 10**6)


def _random_text(rng: random.Random) -> str:
    alphabets = ["abc xyz", "0123456789+-=", "日本語の文章", "émoji 🙂🚀", '\n\t "\\{}', "ÄÖÜß"]
    return "".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randrange(0, 200)))


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE (GPT-2 style, as tiktoken, Llama 3 and Qwen are) with no merges: a token per byte,
    the most tokens any byte-level tokenizer makes of a text."""
    from composer_serverless.models.loading import train_tokenizer

    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog " * 50], vocab_size=258)
    assert len(tokenizer) == 256 + 2  # the bytes and EOS, PAD: nothing merged
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_the_input_bound_holds_for_a_real_tokenizer_and_chat_template(bpe, template):
    rng = random.Random(0)
    template_tokens = []
    for _ in range(200):
        system = _random_text(rng) if rng.random() < 0.5 else None
        config = HarvestConfig(teachers=[TEACHER], threshold=1, max_usd=1, system=system or None)
        prompt = _random_text(rng) or "x"
        body = request_body(config, TEACHER, prompt)
        tokens = bpe.apply_chat_template(
            messages(config, prompt), chat_template=template, add_generation_prompt=True, tokenize=True
        )
        count = len(tokens["input_ids"])
        assert count <= input_token_bound(body), (prompt, system, count, len(body))
        template_tokens.append(count - sum(len(m["content"].encode()) for m in messages(config, prompt)))
    # The template's own tokens are real: a bound of the text's bytes alone would not hold.
    assert min(template_tokens) > 0


def _run(coro):
    return asyncio.run(coro)


def test_a_request_that_cannot_fit_is_refused_and_one_that_can_waits_for_the_ones_in_flight():
    async def scenario():
        budget = Budget(Fraction(10))
        assert await budget.reserve(Fraction(6))
        waiting = asyncio.ensure_future(budget.reserve(Fraction(6)))  # 6 + 6 > 10: waits
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert not await budget.reserve(Fraction(11))  # could never fit: refused at once
        await budget.settle(Fraction(6), Fraction(1))  # came back cheap: 1 + 6 <= 10
        assert await waiting
        assert (budget.spent, budget.in_flight, budget.refused) == (1, 6, 1)
        await budget.settle(Fraction(6), Fraction(6))
        assert not await budget.reserve(Fraction(4))  # 7 + 4 > 10
        assert await budget.reserve(Fraction(3))  # 7 + 3 == 10: exactly the cap is allowed
        return budget

    assert _run(scenario()).in_flight == 3


def test_a_waiting_request_is_refused_when_the_settled_spend_leaves_it_no_room():
    async def scenario():
        budget = Budget(Fraction(10))
        assert await budget.reserve(Fraction(6))
        waiting = asyncio.ensure_future(budget.reserve(Fraction(6)))
        await asyncio.sleep(0.01)
        await budget.settle(Fraction(6), Fraction(5))  # 5 + 6 > 10 even with nothing in flight
        return await waiting

    assert _run(scenario()) is False


def test_an_overrun_stops_everything():
    async def scenario():
        budget = Budget(Fraction(10))
        assert await budget.reserve(Fraction(1))
        await budget.settle(Fraction(1), Fraction(2), overrun="the bound was wrong")
        return budget, await budget.reserve(Fraction(1))

    budget, allowed = _run(scenario())
    assert not allowed and budget.broken == "the bound was wrong" and budget.spent == 2


def test_every_reservation_is_recorded_before_its_request_may_go():
    """With ``record``, reserve returns only once a bound covering the new reservation is recorded: what the
    budget charged since it was made plus everything in flight at its worst case. A reservation the bound
    already covers writes nothing; a record that fails leaves nothing reserved."""
    recorded = []

    async def record(bound):
        recorded.append(bound)

    async def scenario():
        budget = Budget(Fraction(10), spent=Fraction(4), record=record)  # 4 spent by earlier harvests
        assert await budget.reserve(Fraction(2)) and recorded == [2]
        assert await budget.reserve(Fraction(1)) and recorded == [2, 3]
        await budget.settle(Fraction(2), Fraction(1))  # 1 charged, 1 in flight: the bound is 2
        assert await budget.reserve(Fraction(1)) and recorded == [2, 3]  # 3 covers 1 + 1 + 1
        assert await budget.reserve(Fraction(1)) and recorded == [2, 3, 4]

        async def refused(bound):
            raise OSError("the store is down")

        failing = Budget(Fraction(10), record=refused)
        with pytest.raises(OSError):
            await failing.reserve(Fraction(1))
        return failing.in_flight

    assert _run(scenario()) == 0

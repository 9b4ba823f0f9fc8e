"""The GSM8K recipe's rewards (deploy/configs/gsm8k_reward.py): only the answer line the recipe asks for,
``#### <number>`` as the last line, scores; noise, other answer styles and truncated completions score 0."""

import importlib.util
from pathlib import Path

import pytest

REWARD_FILE = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "gsm8k_reward.py"


@pytest.fixture(scope="module")
def gsm8k():
    spec = importlib.util.spec_from_file_location("gsm8k_reward_under_test", REWARD_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOLD_72 = "Each box holds 24 pencils.\nThree boxes hold 3 * 24 = <<3*24=72>>72 pencils.\n#### 72"
# (completion, the row's answer, truncated, correct, formatted)
CASES = [
    # What the issue found scored as correct: noise whose last digit matched, answers in other styles, and
    # completions cut before their answer.
    ("#._9%4HM", "Two and two.\n#### 4", False, 0.0, 0.0),
    ("3 * 24 = 72\n#### $72", GOLD_72, False, 0.0, 0.0),
    ("3 * 24 = 72\n#### 72.", GOLD_72, False, 0.0, 0.0),
    ("3 * 24 = 72, so the answer is \\boxed{72}", GOLD_72, False, 0.0, 0.0),
    ("3 * 24 = 72\n#### 72 clips", GOLD_72, False, 0.0, 0.0),
    ("Each box holds 24, so three boxes hold 72, and then she gives", GOLD_72, True, 0.0, 0.0),
    # Cut inside the answer line: "#### 12" is what the limit left of "#### 120"; the same text finished
    # is right.
    ("3 * 40 = 120\n#### 12", "4 * 3 = <<4*3=12>>12\n#### 12", True, 0.0, 0.0),
    ("3 * 40 = 120\n#### 12", "4 * 3 = <<4*3=12>>12\n#### 12", False, 1.0, 1.0),
    # The answer line, not last: the completion went on.
    ("#### 72\nHope this helps!", GOLD_72, False, 0.0, 0.0),
    # The format asked for, as GSM8K writes numbers.
    ("3 * 24 = 72\n#### 72", GOLD_72, False, 1.0, 1.0),
    ("3 * 24 = 72\n####72  \n\n", GOLD_72, False, 1.0, 1.0),
    ("#### 72.0", GOLD_72, False, 1.0, 1.0),
    ("#### 1,200", "#### 1200", False, 1.0, 1.0),
    ("#### 1200", "#### 1,200", False, 1.0, 1.0),
    ("#### -3", "#### -3", False, 1.0, 1.0),
    ("#### 0.5", "#### 0.5", False, 1.0, 1.0),
    ("#### 1,20", "#### 120", False, 0.0, 0.0),
    # Formatted and wrong.
    ("3 * 24 = 71\n#### 71", GOLD_72, False, 0.0, 1.0),
    # A row whose answer has no final answer line: correct does not apply to it.
    ("#### 72", "seventy-two", False, None, 1.0),
]


@pytest.mark.parametrize(("completion", "answer", "truncated", "correct", "formatted"), CASES)
def test_only_the_answer_line_asked_for_scores(gsm8k, completion, answer, truncated, correct, formatted):
    got = gsm8k.correct(["q"], [completion], answer=[answer], truncated=[truncated])
    assert got["rewards"] == [correct]
    assert gsm8k.formatted(["q"], [completion], truncated=[truncated]) == [formatted]


def test_a_wrong_answer_gets_the_right_one_as_feedback_as_gsm8k_writes_it(gsm8k):
    got = gsm8k.correct(
        ["q"] * 3, ["#### 71", "#### 72", "#### 1"], answer=[GOLD_72, GOLD_72, "#### 1,234,567"]
    )
    assert got == {
        "rewards": [0.0, 1.0, 0.0],
        "feedback": ["The correct final answer is 72.", None, "The correct final answer is 1234567."],
    }


def test_called_as_trl_calls_it_a_completion_counts_as_finished(gsm8k):
    """TRL passes no ``truncated``; conversational completions are read from their last message."""
    conversation = [{"role": "assistant", "content": "3 * 24 = 72\n#### 72"}]
    assert gsm8k.correct(["q"], [conversation], answer=[GOLD_72], completion_ids=[[1, 2]])["rewards"] == [1.0]
    assert gsm8k.formatted(["q"], [conversation], completion_ids=[[1, 2]]) == [1.0]

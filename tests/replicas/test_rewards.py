"""Built-in rewards, user rewards by import path, and their weighted sum with feedback."""

import sys

import pytest

from composer_serverless.config import RewardConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.objectives.rewards import (
    RewardError,
    RewardSet,
    Score,
    exact_match,
    load_user_reward,
)

RECORD = PromptRecord(prompt="add 2 3=", answer="5", source="train.jsonl:7")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `user_rewards` on sys.path with a good reward, a broken one and a non-callable."""
    (tmp_path / "user_rewards.py").write_text(
        "from composer_serverless.objectives.rewards import Score\n"
        "THRESHOLD = 3\n"
        "def short(completion, record):\n"
        "    return 1.0 if len(completion) <= THRESHOLD else 0.0\n"
        "def with_feedback(completion, record):\n"
        "    return Score(0.0, 'too long') if len(completion) > THRESHOLD else Score(1.0)\n"
        "def wrong_type(completion, record):\n"
        "    return 'yes'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def test_exact_match_ignores_surrounding_whitespace_and_gives_the_answer_as_feedback():
    assert exact_match(" 5\n", RECORD) == Score(1.0)
    assert exact_match("6", RECORD) == Score(0.0, "The expected answer is 5.")


def test_rewards_are_summed_with_their_weights_and_feedback_is_collected():
    rewards = RewardSet(
        [RewardConfig(fn="exact_match"), RewardConfig(fn="format", pattern=r"\d+", weight=0.5)]
    )
    scored = rewards.score(["5", "x", "7"], [RECORD] * 3)
    assert scored.totals == [1.5, 0.0, 0.5]
    assert scored.by_reward == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert scored.feedback[0] is None
    assert scored.feedback[1] == "The expected answer is 5.\nThe answer must match the pattern \\d+."
    assert scored.feedback[2] == "The expected answer is 5."


def test_two_rewards_of_one_kind_get_distinct_names():
    rewards = RewardSet([RewardConfig(fn="format", pattern="a"), RewardConfig(fn="format", pattern="b")])
    assert [r.name for r in rewards.rewards] == ["format#0", "format#1"]


def test_unit_tests_score_the_fraction_passed_and_report_the_first_failure():
    record = PromptRecord(prompt="p", tests=("assert inc(1) == 2", "assert inc(2) == 4"))
    scored = RewardSet([RewardConfig(fn="unit_tests", timeout_s=30)]).score(
        ["def inc(x):\n    return x + 1\n"], [record]
    )
    assert scored.totals == [0.5]
    assert scored.feedback == ["A test failed: assert inc(2) == 4 -> AssertionError"]


def test_a_record_without_the_field_a_reward_needs_is_named_by_file_and_line():
    record = PromptRecord(prompt="p", source="data/train.jsonl:12")
    with pytest.raises(RewardError, match=r"data/train.jsonl:12: reward exact_match needs 'answer'"):
        RewardSet([RewardConfig(fn="exact_match")]).check([RECORD, record])
    with pytest.raises(RewardError, match=r"data/train.jsonl:12: reward unit_tests needs 'tests'"):
        RewardSet([RewardConfig(fn="unit_tests")]).check([record])


def test_user_rewards_are_called_with_the_completion_and_the_record(user_module):
    rewards = RewardSet(
        [RewardConfig(fn=f"{user_module}:short"), RewardConfig(fn=f"{user_module}:with_feedback", weight=2.0)]
    )
    scored = rewards.score(["ab", "abcd"], [RECORD, RECORD])
    assert scored.totals == [3.0, 0.0]
    assert scored.feedback == [None, "too long"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_package.rewards:score", r"cannot import 'no_such_package.rewards' \(ModuleNotFoundError"),
        ("user_rewards:missing", r"module 'user_rewards' has no attribute 'missing'"),
        ("user_rewards:THRESHOLD", r"'THRESHOLD' is a int, not a function"),
        ("user_rewards", r"expected an import path 'package.module:function'"),
    ],
)
def test_a_user_reward_that_cannot_be_resolved_says_why(user_module, path, message):
    with pytest.raises(RewardError, match=message) as error:
        load_user_reward(path)
    assert repr(path) in str(error.value)


def test_a_user_reward_must_return_a_number_or_a_score(user_module):
    rewards = RewardSet([RewardConfig(fn=f"{user_module}:wrong_type")])
    with pytest.raises(RewardError, match="returned str; return a float or a Score"):
        rewards.score(["x"], [RECORD])

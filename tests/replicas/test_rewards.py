"""Rewards as TRL writes them: built-ins and user rewards (by file or import path), called with the prompts,
completions, completion ids and every column; None where a reward does not apply; async rewards; feedback."""

import sys

import pytest

from composer_serverless.config import RewardConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.objectives.rewards import (
    RewardError,
    RewardSet,
    call_arguments,
    exact_match,
    load_user_reward,
)

RECORD = PromptRecord(prompt="add 2 3=", columns={"answer": "5", "task": "add"}, source="train.jsonl:7")
USER_REWARDS = """
import asyncio

THRESHOLD = 3

def short(prompts, completions, completion_ids, **kwargs):
    return [1.0 if len(c) <= THRESHOLD else 0.0 for c in completions]

def with_feedback(prompts, completions, **kwargs):
    long = [len(c) > THRESHOLD for c in completions]
    return {"rewards": [0.0 if x else 1.0 for x in long], "feedback": ["too long" if x else None for x in long]}

def solution_only(completions, solution, **kwargs):
    return [None if s is None else float(c == s) for c, s in zip(completions, solution)]

async def slow_accuracy(prompts, completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

def wrong_type(prompts, completions, **kwargs):
    return ["yes"] * len(completions)

def too_few(prompts, completions, **kwargs):
    return [1.0]

def per_item(completion, record):
    return 1.0

def raises_inside(prompts, completions, **kwargs):
    return [int(c) for c in completions]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``user_rewards`` on sys.path, and the same code as a file next to a config."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def test_rewards_are_called_with_every_column_as_trl_calls_them():
    rows = [RECORD, PromptRecord(prompt=({"role": "user", "content": "hi"},), columns={"solution": "x"})]
    kwargs = call_arguments(rows, ["5", "x"], [[7, 2], [9]], [True, False])
    assert kwargs == {
        "prompts": ["add 2 3=", [{"role": "user", "content": "hi"}]],
        # A conversational prompt's completion is a conversation too, as in TRL.
        "completions": ["5", [{"role": "assistant", "content": "x"}]],
        "completion_ids": [[7, 2], [9]],
        "truncated": [True, False],  # beside TRL's arguments: the first hit the length limit
        "answer": ["5", None],
        "task": ["add", None],
        "solution": [None, "x"],
    }


def test_exact_match_ignores_surrounding_whitespace_gives_the_answer_as_feedback_and_skips_rows_without_one():
    out = exact_match([" 5\n", "6", "6"], answer=["5", "5", None])
    assert out == {"rewards": [1.0, 0.0, None], "feedback": [None, "The expected answer is 5.", None]}


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


def test_a_reward_of_weight_0_is_scored_and_reported_but_adds_nothing_and_gives_no_hint():
    """exact_match as an evaluation metric beside a format reward of weight 0.5: the totals are the format
    reward's alone (0.5, 0, 0.5), exact_match's values are still there (1, 0, 0), and its feedback (the
    expected answer) reaches no hint."""
    rewards = RewardSet(
        [RewardConfig(fn="exact_match", weight=0), RewardConfig(fn="format", pattern=r"\d+", weight=0.5)]
    )
    scored = rewards.score(["5", "x", "7"], [RECORD] * 3)
    assert scored.totals == [0.5, 0.0, 0.5]
    assert scored.by_reward == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert scored.feedback == [None, "The answer must match the pattern \\d+.", None]


def test_a_metric_of_weight_0_does_not_switch_sdpo_on(tmp_path):
    """alpha = 'auto' turns SDPO on when the task gives feedback: a built-in of weight 0 (whose feedback no
    hint shows) does not count, neither in the config's reading nor in the launcher's reward check."""
    from composer_serverless.config import validate_config
    from composer_serverless.objectives import inputs, reward_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "add 2 3=", "answer": "5"}\n')
    (tmp_path / "my_task.py").write_text(
        "def short(completions, **kw):\n    return [float(len(c) < 4) for c in completions]\n"
    )

    def config(weight: float):
        rewards = [{"fn": "my_task.py:short"}, {"fn": "exact_match", "weight": weight}]
        return validate_config(
            {
                "model": {"tiny": {}},
                "diloco": {"sync_every": 1, "rounds": 1},
                "train": {"objective": "composer"},
                "code": {"root": str(tmp_path)},
                "composer": {"data": {"prompts": str(prompts), "heldout": str(prompts)}, "rewards": rewards},
            }
        )

    records = inputs.read_prompt_set(config(0).composer, heldout=False)
    for weight, on in ((0.0, False), (1.0, True)):
        checked = reward_check.check(config(weight))
        assert checked == {"problems": [], "feedback": on}
        assert inputs.sdpo_weight(config(weight).composer, records, checked["feedback"]) == float(on)


def test_a_reward_that_does_not_apply_to_a_row_leaves_it_out_of_the_sum():
    """TRL's nansum: a None adds nothing; a row no reward applies to scores 0."""
    rows = [RECORD, PromptRecord(prompt="p")]
    scored = RewardSet([RewardConfig(fn="exact_match", weight=2.0)]).score(["5", "5"], rows)
    assert scored.totals == [2.0, 0.0] and scored.by_reward == {"exact_match": [1.0, None]}


def test_two_rewards_of_one_name_get_distinct_names():
    rewards = RewardSet([RewardConfig(fn="format", pattern="a"), RewardConfig(fn="format", pattern="b")])
    assert [r.name for r in rewards.rewards] == ["format#0", "format#1"]


def test_unit_tests_score_the_fraction_passed_and_report_the_first_failure():
    record = PromptRecord(prompt="p", columns={"tests": ["assert inc(1) == 2", "assert inc(2) == 4"]})
    scored = RewardSet([RewardConfig(fn="unit_tests", timeout_s=30)]).score(
        ["def inc(x):\n    return x + 1\n"], [record]
    )
    assert scored.totals == [0.5]
    assert scored.feedback == ["A test failed: assert inc(2) == 4 -> AssertionError"]


def test_user_rewards_by_import_path_get_columns_weights_names_and_feedback(user_module):
    rewards = RewardSet(
        [
            RewardConfig(fn=f"{user_module}:short"),
            RewardConfig(fn=f"{user_module}:with_feedback", weight=2.0),
            RewardConfig(fn=f"{user_module}:slow_accuracy", name="accuracy"),
        ]
    )
    assert [r.name for r in rewards.rewards] == ["short", "with_feedback", "accuracy"]
    scored = rewards.score(["5", "abcd"], [RECORD, RECORD])
    assert scored.totals == [1.0 + 2.0 + 1.0, 0.0]
    assert scored.by_reward["accuracy"] == [1.0, 0.0]  # the async reward, awaited
    assert scored.feedback == [None, "too long"]


def test_a_reward_file_relative_to_the_config_is_imported_by_path(tmp_path):
    (tmp_path / "my_task.py").write_text(USER_REWARDS)
    row = PromptRecord(prompt="q", columns={"solution": "42"})
    rewards = RewardSet([RewardConfig(fn="my_task.py:solution_only")], code_root=tmp_path)
    assert rewards.score(["42", "41"], [row, row]).totals == [1.0, 0.0]
    assert "user_rewards" not in sys.modules and "my_task" not in sys.modules  # no module name taken
    with pytest.raises(RewardError, match=rf"reward file {tmp_path / 'other.py'} does not exist\n  fix: "):
        load_user_reward("other.py:f", tmp_path)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "no_such_package.rewards:score",
            r"importing 'no_such_package.rewards' failed \(ModuleNotFoundError",
        ),
        ("user_rewards:missing", r"'user_rewards' has no attribute 'missing'"),
        ("user_rewards:THRESHOLD", r"'THRESHOLD' is a int, not a function"),
        ("user_rewards", r"expected 'file.py:function' or 'package.module:function'"),
    ],
)
def test_a_user_reward_that_cannot_be_resolved_says_why(user_module, path, message):
    with pytest.raises(RewardError, match=message) as error:
        load_user_reward(path, None)
    assert repr(path) in str(error.value)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("wrong_type", r"returned 'yes'; a reward is a finite number, or None"),
        ("too_few", r"returned 1 values for 2 completions"),
        ("per_item", r"(?s)cannot be called as rewards are.*unexpected keyword argument.*\*\*kwargs"),
    ],
)
def test_a_user_reward_must_be_called_and_answer_as_trl_rewards_do(user_module, fn, message):
    rewards = RewardSet([RewardConfig(fn=f"{user_module}:{fn}")])
    with pytest.raises(RewardError, match=message):
        rewards.score(["x", "y"], [RECORD, RECORD])


def test_an_error_inside_a_reward_is_its_own_not_a_signature_problem(user_module):
    rewards = RewardSet([RewardConfig(fn=f"{user_module}:raises_inside")])
    with pytest.raises(ValueError, match="invalid literal for int") as raised:
        rewards.score(["x"], [RECORD])
    assert not isinstance(raised.value, RewardError)

"""The hint builder: record hint, a sibling's success, else feedback; no hint, no distillation."""

import pytest

from composer_serverless.config import HintConfig
from composer_serverless.data.chat import Rendered
from composer_serverless.data.records import PromptRecord
from composer_serverless.objectives.hints import HintBuilder

RECORD = PromptRecord(prompt="add 2 3=", columns={"answer": "5"})


def texts(prompts):
    return [None if p is None else p.text for p in prompts]


def test_a_failed_row_sees_a_successful_sibling_and_a_success_sees_another_success():
    builder = HintBuilder(HintConfig())
    prompts = texts(
        builder.group_hints(
            [RECORD] * 4,
            ["4", "5", "5 ", "x"],
            [0.0, 1.0, 1.0, 0.0],
            ["The expected answer is 5.", None, None, "bad"],
            4,
        )
    )
    assert prompts[0] == "A correct answer: 5\nadd 2 3="
    assert prompts[1] == "A correct answer: 5 \nadd 2 3="  # its sibling's, never its own
    assert prompts[2] == "A correct answer: 5\nadd 2 3="
    assert prompts[3] == "A correct answer: 5\nadd 2 3="


def test_without_a_solution_the_feedback_is_the_hint_and_a_lone_success_gets_none():
    builder = HintBuilder(HintConfig())
    prompts = texts(
        builder.group_hints(
            [RECORD] * 2 + [RECORD] * 2,
            ["4", "6", "5", "7"],
            [0.0, 0.0, 1.0, 0.0],
            ["The expected answer is 5.", None, None, "The expected answer is 5."],
            2,
        )
    )
    assert prompts == ["The expected answer is 5.\nadd 2 3=", None, None, "A correct answer: 5\nadd 2 3="]


def test_the_record_hint_comes_first_and_templates_are_configurable():
    config = HintConfig(
        template="{prompt} [{hint}]",
        solution="try {solution}",
        feedback="note: {feedback}",
        use_solutions=False,
    )
    record = PromptRecord(prompt="p=", columns={"hint": "think about carries"})
    builder = HintBuilder(config)
    assert texts(builder.group_hints([record] * 2, ["a", "b"], [1.0, 0.0], [None, "wrong"], 2)) == [
        "p= [think about carries]",
        "p= [think about carries\nnote: wrong]",
    ]


def test_rows_must_form_whole_groups():
    with pytest.raises(ValueError, match="do not form groups of 4"):
        HintBuilder(HintConfig()).group_hints([RECORD] * 3, ["a"] * 3, [0.0] * 3, [None] * 3, 4)


def test_a_conversation_gets_its_hint_in_its_last_user_turn_its_system_turn_kept():
    system = {"role": "system", "content": "Be brief."}
    record = PromptRecord(prompt=(system, {"role": "user", "content": "add 2 3="}), columns={"answer": "5"})
    rendered: list = []
    builder = HintBuilder(HintConfig(), render=lambda prompt: rendered.append(prompt) or Rendered("x", True))
    builder.group_hints([record] * 2, ["4", "6"], [0.0, 0.0], ["The expected answer is 5.", None], 2)
    assert rendered == [(system, {"role": "user", "content": "The expected answer is 5.\nadd 2 3="})]

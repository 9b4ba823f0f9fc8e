"""Normalisation and the vote, with hand-made answers."""

import pytest

from composer_serverless.config import NormaliseConfig
from composer_serverless.harvest.answers import Answer, normalise, normalise_student, vote

PLAIN = NormaliseConfig()
FINAL = NormaliseConfig(final_answer=r"answer is\s*(\S+)", casefold=True, trim_chars=".")


@pytest.mark.parametrize(
    ("rule", "text", "expected"),
    [
        (PLAIN, "  7 \n", "7"),
        (PLAIN, "a\t\n b", "a b"),
        (NormaliseConfig(collapse_whitespace=False), " a\t b ", "a\t b"),
        (NormaliseConfig(strip=False), " a  b ", " a b "),
        (FINAL, "The answer is 4. No wait, the answer is 5.", "5"),
        (FINAL, "so the answer is   Ab.", "Ab"),
        (NormaliseConfig(final_answer=r"\d+"), "between 3 and 12", "12"),  # no group: the whole last match
    ],
)
def test_normalised_text(rule, text, expected):
    answer = normalise(text, rule)
    assert answer is not None and answer.text == expected


def test_case_folding_changes_the_key_not_the_text():
    assert normalise("Paris", FINAL.model_copy(update={"final_answer": None})) == Answer("Paris", "paris")
    assert normalise("Paris", PLAIN) == Answer("Paris", "Paris")


def test_a_teacher_without_a_final_answer_or_with_nothing_left_abstains():
    assert normalise("I cannot tell", FINAL) is None
    assert normalise(" \n ", PLAIN) is None
    assert normalise("the answer is ...", FINAL) is None  # "..." trimmed to nothing


def test_the_student_is_compared_whole_when_the_rule_finds_nothing():
    assert normalise_student(" 5. ", FINAL) == Answer("5", "5")
    assert normalise_student("the answer is 6", FINAL) == Answer("6", "6")


def _answers(*texts):
    return {f"t{i}": None if t is None else normalise(t, PLAIN) for i, t in enumerate(texts)}


def test_two_of_three_choose_and_the_first_voter_writes_the_text():
    rule = NormaliseConfig(casefold=True)
    answers = {"a": normalise("Yes", rule), "b": normalise("no", rule), "c": normalise("YES", rule)}
    verdict = vote(answers, 2)
    assert (verdict.chosen, verdict.key, verdict.votes, verdict.voters, verdict.reason) == (
        "Yes",
        "yes",
        2,
        ("a", "c"),
        "agreed",
    )


def test_below_threshold_ties_and_abstentions():
    assert vote(_answers("1", "2", "3"), 2).reason == "below threshold"
    assert vote(_answers("1", None, "1"), 2).voters == ("t0", "t2")  # an abstention is no vote
    assert vote(_answers("1", None, None), 2).reason == "below threshold"
    assert vote(_answers(None, None, None), 1).reason == "below threshold"
    tied = vote(_answers("1", "2", "2", "1"), 2)
    assert (tied.chosen, tied.reason, tied.votes) == (None, "tied", 2)
    assert vote(_answers("1", "2", "2", "1", "2"), 2).chosen == "2"
    assert vote(_answers("9"), 1).chosen == "9"

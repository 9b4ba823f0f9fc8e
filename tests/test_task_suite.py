"""The offline task suite: regenerating it reproduces the committed files byte for byte; pairs are sound."""

import json
from pathlib import Path

import pytest

from composer_serverless.data import task_suite
from composer_serverless.data.records import read_pairs, read_prompts

COMMITTED = Path(__file__).resolve().parents[1] / "deploy" / "data" / "composer-tasks"


def test_regenerating_reproduces_the_committed_files_byte_for_byte(tmp_path):
    counts = task_suite.write(tmp_path)
    for name in counts:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (COMMITTED / f"{name}.jsonl").read_bytes(), name
    assert sorted(p.name for p in COMMITTED.iterdir()) == sorted(f"{name}.jsonl" for name in counts)


def test_every_file_parses_and_held_out_prompts_never_occur_in_training():
    train, heldout = (
        read_prompts(str(COMMITTED / "train.jsonl")),
        read_prompts(str(COMMITTED / "heldout.jsonl")),
    )
    assert {r.task for r in train} == {r.task for r in heldout} == {t.name for t in task_suite.TASKS}
    assert not {r.prompt for r in train} & {r.prompt for r in heldout}
    assert all(
        len([r for r in heldout if r.task == t.name]) == task_suite.HELDOUT_PER_TASK for t in task_suite.TASKS
    )
    solvers = {t.name: t.solve for t in task_suite.TASKS}
    for record in train + heldout:
        argument = record.prompt[len(record.task) + 1 : -1]
        assert record.answer == solvers[record.task](argument), record


def test_pairs_prefer_the_teachers_majority_over_the_students_answer():
    traces = [json.loads(line) for line in (COMMITTED / "traces.jsonl").read_text().splitlines()]
    pairs = read_pairs(str(COMMITTED / "pairs.jsonl"))
    assert len(set(next(iter(t["teachers"].values())) for t in traces)) > 1
    assert all(len(t["teachers"]) >= 3 for t in traces)
    by_prompt = {t["prompt"]: t for t in traces}
    for pair in pairs:
        trace = by_prompt[pair.prompt]
        votes = list(trace["teachers"].values())
        assert votes.count(pair.chosen) >= 2
        assert pair.rejected == trace["student"] != pair.chosen
    disagreements = sum(len(set(t["teachers"].values())) > 1 for t in traces)
    assert disagreements > 0, "the teachers should disagree sometimes, or majority voting is never exercised"


@pytest.mark.parametrize(
    ("answers", "majority"), [(["1", "1", "2"], "1"), (["1", "2", "3"], None), (["4", "4", "4"], "4")]
)
def test_majority(answers, majority):
    assert task_suite.majority(answers) == majority


@pytest.mark.parametrize(
    ("completion", "credit"),
    [("259", 1.0), (" 259\n", 1.0), ("2", 1 / 3), ("25999", 0.6), ("x", 0.0), ("", 0.0)],
)
def test_prefix_credit(completion, credit):
    assert task_suite.prefix_credit([completion], answer=["259"], prompts=["sort 592="]) == [
        pytest.approx(credit)
    ]

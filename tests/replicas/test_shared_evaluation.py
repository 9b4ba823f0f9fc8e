"""A round's evaluation is shared out: the lowest-rank participant adds up the shares the others published,
and scores itself any share that does not come."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_serverless.config import validate_config
from composer_serverless.models.loading import load_pretrained
from composer_serverless.objectives.objective import evaluate
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.replicas import evaluation
from composer_serverless.replicas.trainer import Replica


def make_replica(run: ObjectStore, rank: int, model_dir: Path) -> Replica:
    config = validate_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "diloco": {"replicas": 3, "sync_every": 2, "rounds": 2},
            "eval": {"sequences": 9},
        }
    )
    model, tokenizer = load_pretrained(model_dir, "float32")
    return Replica(run, config, rank, Reporter(run, rank), model, tokenizer)


def test_the_lowest_rank_participant_adds_up_the_published_shares(tiny_model_dir: Path) -> None:
    run = ObjectStore("memory://shared-eval/published")
    lowest = make_replica(run, 0, tiny_model_dir)
    params = dict(lowest.model.named_parameters())
    # Replica 2 (share 1 of 2 in a round whose participants are 0 and 2) published a share with values no
    # real share has, so that its use shows in the result.
    run.put(layout.eval_share(4, 1, 2), evaluation.dumps({"eval/loss": (100.0, 4)}))
    own = lowest.objective.evaluate_part(lowest.model, 0, 2)
    result = lowest._evaluate(4, [0, 2], params)
    assert result == {"eval/loss": pytest.approx((own["eval/loss"][0] + 100.0) / (own["eval/loss"][1] + 4))}
    other = make_replica(run, 2, tiny_model_dir)
    assert other._evaluate(5, [0, 2], params) is None
    assert evaluation.loads(run.get(layout.eval_share(5, 1, 2))) == other.objective.evaluate_part(
        other.model, 1, 2
    )


def test_a_share_that_never_comes_is_scored_by_the_lowest_rank_participant(tiny_model_dir: Path) -> None:
    run = ObjectStore("memory://shared-eval/missing")
    lowest = make_replica(run, 0, tiny_model_dir)
    run.put(layout.eval_share(3, 2, 3), b'{"eval/loss": "not a share"}')  # malformed: scored again too
    result = lowest._evaluate(3, [0, 1, 2], dict(lowest.model.named_parameters()))
    assert result == {
        "eval/loss": pytest.approx(evaluate(lowest.objective, lowest.model)["eval/loss"], rel=1e-6)
    }


def test_a_malformed_share_is_scored_at_once_and_reported_once(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = ObjectStore("memory://shared-eval/malformed")
    lowest = make_replica(run, 0, tiny_model_dir)
    run.put(layout.eval_share(6, 1, 2), b'{"eval/loss": [1.0]}')
    with caplog.at_level("WARNING", logger="composer_serverless.replicas.trainer"):
        result = lowest._evaluate(6, [0, 1], dict(lowest.model.named_parameters()))
    assert result == {
        "eval/loss": pytest.approx(evaluate(lowest.objective, lowest.model)["eval/loss"], rel=1e-6)
    }
    # One line naming the bad share, and no wait for the deadline (which would log the missing replicas).
    assert [r.getMessage() for r in caplog.records] == [
        "[replica 0] round 6: evaluation share 1 is malformed "
        "(evaluation share entry 'eval/loss' is not [sum, count]: [1.0]); scoring it here"
    ]


def test_a_replica_that_did_not_take_part_has_no_share(tiny_model_dir: Path) -> None:
    run = ObjectStore("memory://shared-eval/late")
    late = make_replica(run, 1, tiny_model_dir)
    assert late._evaluate(2, [0, 2], dict(late.model.named_parameters())) is None
    assert run.list_tree("evals") == []

"""Evaluation shares: the arithmetic that combines them, and what a share read from the store may be."""

from __future__ import annotations

import pytest

from composer_serverless.config import validate_config
from composer_serverless.models.loading import load_pretrained
from composer_serverless.objectives.lm import LMObjective
from composer_serverless.objectives.objective import evaluate
from composer_serverless.objectives.shares import combine, share
from composer_serverless.rendezvous import layout
from composer_serverless.replicas.evaluation import dumps, loads


def test_shares_take_every_nth_item_and_cover_the_set_once():
    items = list(range(10))
    shares = [share(items, p, 3) for p in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert share(items[:2], 2, 3) == []
    with pytest.raises(ValueError, match="part 3 is outside"):
        share(items, 3, 3)


def test_combine_weights_each_share_by_its_count():
    # Loss 2.0 over 4 sequences and 5.0 over 2: (8 + 10) / 6 = 3.0, not the mean of the means (3.5).
    # A metric only one share has (a task the other share lacks) is that share's mean.
    parts = [{"eval/loss": (8.0, 4), "eval/task/a/reward": (1.0, 2)}, {"eval/loss": (10.0, 2)}, {}]
    assert combine(parts) == {"eval/loss": 3.0, "eval/task/a/reward": 0.5}


def test_a_share_round_trips_and_a_malformed_one_is_refused():
    part = {"eval/loss": (8.25, 4), "eval/reward": (0.0, 3)}
    assert loads(dumps(part)) == part
    assert layout.eval_share(7, 1, 3) == "evals/7/1-of-3.json"
    for raw in (
        b"[]",
        b'{"eval/loss": 3}',
        b'{"eval/loss": [1.0]}',
        b'{"eval/loss": ["1", 2]}',
        b'{"x": [1.0, -1]}',
        b'{"x": [1.0, true]}',
    ):
        with pytest.raises(ValueError):
            loads(raw)


def test_lm_shares_add_up_to_the_whole_held_out_loss(tiny_model_dir):
    model, tokenizer = load_pretrained(tiny_model_dir)
    config = validate_config(
        {
            "model": {"tiny": {}},
            "data": {"seq_len": 16, "batch_size": 4},
            "eval": {"sequences": 10},
            "diloco": {"sync_every": 1, "rounds": 1},
        }
    )
    objective = LMObjective(config, tokenizer, rank=0)
    whole = evaluate(objective, model)["eval/loss"]
    shares = [objective.evaluate_part(model, p, 4) for p in range(4)]
    # Counts are predicted tokens: 10 rows of 16 tokens dealt 3, 3, 2, 2, each row predicting 15.
    assert [s["eval/loss"][1] for s in shares] == [45, 45, 30, 30]
    assert combine(shares)["eval/loss"] == pytest.approx(whole, rel=1e-6)

"""The composer objective between rounds: it records its rollouts in the store, takes the pairs a live
harvest wrote (its share of them), scores their DPO references with the round's global model, says which
files each round replayed, and a resumed replica replays the same pairs with the same references."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from composer_serverless.config import validate_config
from composer_serverless.losses.logprobs import completion_logprobs
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.objective import make_objective

TRAIN = [{"prompt": f"add {a} {b}=", "answer": str(a + b), "task": "add"} for a in range(3) for b in range(3)]
TEACHER = {
    "name": "t",
    "base_url": "http://127.0.0.1:9/v1",
    "model": "m",
    "usd_per_m_input": 1.0,
    "usd_per_m_output": 1.0,
}
HARVESTED = [
    {"prompt": f"add {a} 2=", "chosen": str(a + 2), "rejected": str(a), "provenance": {"states": [f"s{a}"]}}
    for a in range(5)
]


@pytest.fixture
def live(jsonl, tmp_path):
    raw = {
        "model": {"tiny": {"tokenizer": "chars", "hidden_size": 32, "intermediate_size": 64, "num_heads": 4}},
        "train": {"objective": "composer"},
        "diloco": {"replicas": 2, "sync_every": 2, "rounds": 3},
        "eval": {"sequences": 2},
        "composer": {
            "alpha": 0.0,
            "beta": 1.0,
            "data": {"prompts": jsonl("train.jsonl", TRAIN), "heldout": jsonl("heldout.jsonl", TRAIN[:2])},
            "rewards": [{"fn": "exact_match"}],
            "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 3},
            "replay": {"pairs_per_step": 2},
        },
        "harvest": {"teachers": [TEACHER], "threshold": 1, "max_usd": 1.0, "live": True},
    }
    return validate_config(raw), ObjectStore(str(tmp_path / "run"))


def _holding(model):
    return lambda: contextlib.nullcontext(model)


def test_rollouts_recorded_pairs_taken_at_the_boundary_and_resumed_alike(live, model, tokenizer):
    config, run = live
    objective = make_objective(config, tokenizer, 1, model=model, run=run)
    loss, metrics = objective.loss(model)
    assert "replay/loss" not in metrics  # no pairs yet: the channel is off, not an error

    assert objective.round_ended(1, _holding(model)) == {"replay_files": [], "replay_files_new": []}
    rows = [json.loads(line) for line in run.get(layout.rollouts(1, 1)).decode().splitlines()]
    assert rows and {r["prompt"] for r in rows} <= {t["prompt"] for t in TRAIN}
    assert all(r["id"].startswith("r1-k1-") and isinstance(r["reward"], float) and r["student"] for r in rows)

    run.put(layout.harvested_pairs(1), "".join(json.dumps(p) + "\n" for p in HARVESTED).encode())
    global_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in global_model.parameters():
            p.mul_(0.5)  # the round's global model is not the replica's local one
    fields = objective.round_ended(2, _holding(global_model))
    assert fields == {"replay_files": [], "replay_files_new": ["harvest/pairs/000001.jsonl"]}
    assert objective.round_ended(3, _holding(global_model))["replay_files"] == ["harvest/pairs/000001.jsonl"]

    # Rank 1 of 2 takes pairs 1 and 3; their references are the global model's log-probs.
    state = json.loads(json.dumps(objective.state_dict()))
    (entry,) = state["harvested"]
    assert entry["file"] == "000001.jsonl" and len(entry["refs"]) == 2
    batch = objective._pairs._batch([0], torch.device("cpu"), with_refs=False)
    global_model.eval()
    expected = completion_logprobs(
        global_model, batch.prompt_ids, batch.prompt_mask, batch.chosen_ids, batch.chosen_mask
    ).sum()
    assert entry["refs"][0][0] == pytest.approx(expected.item(), abs=1e-5)
    _, metrics = objective.loss(model)
    assert metrics["replay/pairs"] == 2

    # A resumed replica takes the same pairs with the stored references, whatever its model now.
    resumed = make_objective(config, tokenizer, 1, model=global_model, run=run)
    resumed.load_state_dict(state)
    assert json.loads(json.dumps(resumed.state_dict())) == state
    one, two = objective._pairs.next(torch.device("cpu")), resumed._pairs.next(torch.device("cpu"))
    assert torch.equal(one.chosen_ids, two.chosen_ids)
    assert torch.equal(one.ref_chosen_logps, two.ref_chosen_logps)

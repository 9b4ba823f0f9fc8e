"""The composer objective between rounds: it records its rollouts in the store, takes the pairs a live
harvest wrote (its share of them) at the round the schedule says, scores their DPO references with the round's
global model, says which files each round replayed, what was decided and how long it waited; a resumed replica
replays the same pairs with the same references and goes on with the schedule, and one that caught up past a
round boundary takes what that boundary's decision took."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from composer_serverless.config import validate_config
from composer_serverless.losses.logprobs import completion_logprobs
from composer_serverless.objectives.objective import make_objective, step_loss
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

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


def _never_waits(what):
    raise AssertionError(f"the replica waited ({what}) though the harvest's report was there")


def _harvested(run, k, pairs):
    """What the launcher leaves of the harvest of round k: the pairs, then the report naming them."""
    run.put(layout.harvested_pairs(k), "".join(json.dumps(p) + "\n" for p in pairs).encode())
    report = {"round": k, "pairs": len(pairs), "pairs_file": layout.harvested_pairs(k), "spent_exact": "0"}
    run.put(layout.harvest_report(k), json.dumps(report).encode())


def test_rollouts_recorded_pairs_taken_at_the_boundary_and_resumed_alike(live, model, tokenizer):
    config, run = live
    objective = make_objective(config, tokenizer, 1, model=model, run=run)
    loss, metrics = step_loss(objective, model)
    assert "replay/loss" not in metrics  # no pairs yet: the channel is off, not an error

    # Round 1's end takes nothing (live_lag 1: round 1's pairs are taken at the end of round 2); its row
    # carries the round's sample of completions for the trackers.
    fields = objective.round_ended(1, _holding(model), _never_waits)
    sample = fields.pop("completions")
    assert sample and all(c["prompt"] in {t["prompt"] for t in TRAIN} for c in sample)
    assert fields == {"replay_files": [], "replay_files_new": []}
    rows = [json.loads(line) for line in run.get(layout.rollouts(1, 1)).decode().splitlines()]
    assert rows and {r["prompt"] for r in rows} <= {t["prompt"] for t in TRAIN}
    assert all(r["id"].startswith("r1-k1-") and isinstance(r["reward"], float) and r["student"] for r in rows)

    _harvested(run, 1, HARVESTED)
    global_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in global_model.parameters():
            p.mul_(0.5)  # the round's global model is not the replica's local one
    fields = objective.round_ended(2, _holding(global_model), _never_waits)
    assert fields.pop("harvest_wait_s") >= 0
    assert fields == {
        "replay_files": [],
        "replay_files_new": ["harvest/pairs/000001.jsonl"],
        "harvest": {"of_round": 1, "outcome": "pairs", "detail": "5 pairs", "decided_by": 1},
    }
    assert json.loads(run.get(layout.harvest_taken(2)))["take"] is True  # decided for every replica
    # Round 3 is the last: a harvest of round 2 would be replayed by no round, so none is taken.
    assert objective.round_ended(3, _holding(global_model), _never_waits) == {
        "replay_files": ["harvest/pairs/000001.jsonl"],
        "replay_files_new": [],
    }

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
    _, metrics = step_loss(objective, model)
    assert metrics["replay/pairs"] == 2

    # A resumed replica takes the same pairs with the stored references, whatever its model now, and goes
    # on with the schedule from the boundary it had reached.
    resumed = make_objective(config, tokenizer, 1, model=global_model, run=run)
    resumed.load_state_dict(state)
    assert json.loads(json.dumps(resumed.state_dict())) == state and state["taken_through"] == 3
    one, two = objective._pairs.next(torch.device("cpu")), resumed._pairs.next(torch.device("cpu"))
    assert torch.equal(one.chosen_ids, two.chosen_ids)
    assert torch.equal(one.ref_chosen_logps, two.ref_chosen_logps)


def test_a_replica_that_caught_up_takes_what_the_boundaries_it_passed_took(live, model, tokenizer):
    """Replica 0 loaded round 2's published state (it did not end rounds 1 and 2): at the end of round 3 it
    takes what the end of round 2 took, as the others did, without waiting for anything."""
    config, run = live
    config = config.model_copy(update={"diloco": config.diloco.model_copy(update={"rounds": 5})})
    _harvested(run, 1, HARVESTED)
    _harvested(run, 2, HARVESTED[:2])
    ender = make_objective(config, tokenizer, 1, model=model, run=run)  # a replica that ended rounds 1-2
    ender.round_ended(1, _holding(model), _never_waits)
    assert ender.round_ended(2, _holding(model), _never_waits)["replay_files_new"] == [
        "harvest/pairs/000001.jsonl"
    ]

    late = make_objective(config, tokenizer, 0, model=model, run=run)
    fields = late.round_ended(3, _holding(model), _never_waits)
    # Round 2's decision (read) and round 3's (made here): the harvests of rounds 1 and 2.
    assert fields["replay_files_new"] == ["harvest/pairs/000001.jsonl", "harvest/pairs/000002.jsonl"]
    assert fields["harvest"] == {"of_round": 2, "outcome": "pairs", "detail": "2 pairs", "decided_by": 0}
    assert [h["file"] for h in late.state_dict()["harvested"]] == ["000001.jsonl", "000002.jsonl"]
    assert len(late._pairs) == 3 + 1  # rank 0 of 2: pairs 0, 2, 4 of the first file and pair 0 of the second


def test_a_resumed_replica_takes_what_its_round_took_before_it_died(live, model, tokenizer):
    """Replica 1 saved its state after round 2, ended round 3 (taking round 2's harvest), and died. Resumed
    from that state, it runs round 3 again and takes what round 3's end took the first time, from the store's
    decision: without waiting, even with the report gone."""
    config, run = live
    config = config.model_copy(update={"diloco": config.diloco.model_copy(update={"rounds": 5})})
    _harvested(run, 1, HARVESTED)
    _harvested(run, 2, HARVESTED[:4])
    first = make_objective(config, tokenizer, 1, model=model, run=run)
    first.round_ended(1, _holding(model), _never_waits)
    first.round_ended(2, _holding(model), _never_waits)
    saved = json.loads(json.dumps(first.state_dict()))
    before = first.round_ended(3, _holding(model), _never_waits)
    run.delete(layout.harvest_report(2))

    resumed = make_objective(config, tokenizer, 1, model=model, run=run)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["taken_through"] == 2
    after = resumed.round_ended(3, _holding(model), _never_waits)
    assert after["replay_files_new"] == before["replay_files_new"] == ["harvest/pairs/000002.jsonl"]
    assert after["harvest"] == before["harvest"] and after["replay_files"] == before["replay_files"]
    assert json.loads(json.dumps(resumed.state_dict())) == json.loads(json.dumps(first.state_dict()))

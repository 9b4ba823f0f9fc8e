"""Decoupled mode's oracle: with a quorum of every learner, equal speeds, no faults and ``max_lag = 0``, its
learners and syncer (real processes, on the simulated accelerator) end on lock-step DiLoCo's final global,
bit for bit: the same inner steps, the same mean in the same order, the same outer Nesterov step. Its
initial evaluation (version 0, scored by learner 0) is the initial weights' and lock-step's round 0's."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import RunConfig
from composer_serverless.objectives.objective import evaluate, make_objective
from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous.rows import bucket_count, span_rows, spans
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from composer_serverless.replicas import precision
from composer_serverless.replicas.weights import digest, load_run_model
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.rendezvous.harness import create, make_config, run_replicas
from tests.syncer.processes import run_decoupled

LEARNERS = 3
ROUNDS = 3
# A checkpoint at the last round holds lock-step's final global.
SETTINGS = {"replicas": LEARNERS, "rounds": ROUNDS, "min_replicas": LEARNERS}


def lockstep_final(run, rounds: int = ROUNDS) -> dict[str, torch.Tensor]:
    """The global parameters lock-step published after its last round (``rounds``), by model name."""
    tree = checkpoint.load_global(run, rounds)
    originals = tree["user"]["StreamingDiLoCoFragment_0"]["original_parameters"]
    return {name.replace("__", "."): tensor for name, tensor in originals.items()}


def scored_initial(run: ObjectStore, config: RunConfig) -> dict[str, float]:
    """The objective's evaluation of the run's initial weights (its model, loaded with its seed), scored
    whole in this process, on the simulated accelerator as a replica scores."""
    with tempfile.TemporaryDirectory() as cache, simulated():
        torch.manual_seed(config.seed)
        loaded = load_run_model(run, config, Path(cache))
        model = loaded.model.to("cuda")
        objective = make_objective(config, loaded.tokenizer, 0, model=model)
        with precision.compute(config.model, torch.device("cuda")):
            return evaluate(objective, model)


@pytest.mark.slow
@pytest.mark.parametrize(("embeddings", "shards"), [("all", 1), ("touched", 1), ("touched", 2)])
def test_decoupled_with_a_full_quorum_ends_on_lockstep_bit_for_bit(
    tmp_path: Path, tiny_model_dir: Path, embeddings: str, shards: int
) -> None:
    """With either embedding rule: ``touched`` combines each embedding row over the learners whose data held
    its token, from the row bits each contribution carries, as lock-step's reducer does. With the syncer
    sharded by fragment (two processes, each merging its fragment of every contribution) too: the merge is
    per tensor, and each shard's fragment is whole tensors."""
    store = str(tmp_path / "runs")
    settings = {**SETTINGS, "embedding_average": embeddings}
    with replicas_on_the_simulated_accelerator():
        lockstep = create(make_config(store, "lockstep", tiny_model_dir, **settings))
        assert run_replicas(lockstep, tmp_path / "lockstep-logs", LEARNERS) == [0] * LEARNERS
        sharded = {"decoupled": {"syncer_shards": shards}}
        config = make_config(store, "decoupled", tiny_model_dir, mode="decoupled", **settings, **sharded)
        decoupled = create(config)
        codes = run_decoupled(decoupled, tmp_path / "decoupled-logs", LEARNERS, syncers=shards)
        assert codes == [0] * (LEARNERS + shards)
    assert ran_on_the_simulated_accelerator(tmp_path / "lockstep-logs")
    assert ran_on_the_simulated_accelerator(tmp_path / "decoupled-logs")

    final = versions.read_version(decoupled, ROUNDS)
    # Every learner's contribution of every round merged once, none dropped.
    assert sorted(map(tuple, final.merged)) == [(learner, ROUNDS - 1) for learner in range(LEARNERS)]
    assert final.consumed == {learner: ROUNDS for learner in range(LEARNERS)} and final.dropped == []
    assert len(final.parts) == (shards if shards > 1 else 0)
    merged = versions.load_params(decoupled, final, None)
    expected = lockstep_final(lockstep)
    assert set(merged) == set(expected)
    unequal = [name for name in expected if not torch.equal(merged[name], expected[name])]
    assert unequal == [], f"differ from lock-step: {unequal}"
    # ... and it is not the starting point (the model's saved weights; version 0 itself is pruned): it trained.
    initial = safetensors.torch.load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(initial[name], merged[name]) for name in merged if name in initial)

    # Every learner ended holding that global: its last row's digest is the final version's.
    beats = read_heartbeats(decoupled)
    assert [beats[rank]["state"] for rank in range(LEARNERS)] == ["done"] * LEARNERS
    held = {
        json.loads(decoupled.get(layout.metrics(r, ROUNDS))).get("global_sha256") for r in range(LEARNERS)
    }
    assert held == {digest(merged)}

    # Version 0 scored by learner 0 alone, in round 0's row as lock-step's replicas score round 0: the
    # initial weights' evaluation, and lock-step's (scored there in shares).
    initial = json.loads(decoupled.get(layout.metrics(0, 0)))["eval"]
    assert initial == pytest.approx(scored_initial(decoupled, config), rel=1e-6)
    assert initial == pytest.approx(json.loads(lockstep.get(layout.metrics(0, 0)))["eval"], rel=1e-6)
    assert [decoupled.exists(layout.metrics(r, 0)) for r in range(LEARNERS)] == [True, False, False]
    # Each contribution says how long its inner steps took (the syncer's grace window reads it): here the
    # last ones, which the kept version before the last had not consumed. Sharded: each fragment carries the
    # bits of its own token rows.
    fragments = final.fragments or [list(merged)]
    assert len(fragments) == shards
    for fragment, names in enumerate(fragments):
        shapes = {name: tuple(merged[name].shape) for name in names}
        numel = sum(merged[name].numel() for name in names)
        blocks = versions.row_blocks(shapes, final.token_rows)
        bits = span_rows(spans(blocks, 0, numel)) * bucket_count(config.diloco.sync_every)
        for learner in range(LEARNERS):
            c, _ = versions.read_contribution(
                decoupled,
                "decoupled",
                learner,
                ROUNDS - 1,
                "fp32",
                numel,
                None,
                bits,
                fragment=fragment if shards > 1 else None,
            )
            assert c.steps == config.diloco.sync_every and c.step_s is not None and c.step_s > 0
            # with touched rows, the bits of the rows its data held: some, not all
            assert c.touched is None if not bits else 0 < int(c.touched.sum()) < bits
    # the tiny model's embedding (and untied head)
    assert bool(final.token_rows) == (embeddings == "touched")
